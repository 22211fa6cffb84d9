#!/usr/bin/env bash
# FlashInfer for the device machine, carried as wheels (not on the GPU image; nothing can be fetched there).
#
#     bash bench/tools/pack_flashinfer.sh            # here, in the repository root; writes .whl/ (git-ignored)
#
# Downloads `flashinfer-python` 0.7.x and the `apache-tvm-ffi` it requires (py3.12 manylinux x86_64), strips the
# flashinfer wheel to what `import flashinfer` and its FA2 decode / paged prefill JIT need (the import closure of
# `__init__`, `decode`, `prefill`, `page` and `jit/`, and the JIT's headers) and re-zips it (RECORD rewritten).
# Refuses (exit 1) a total over MAX_MIB (default 40); ends with the install command for the device machine.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
PY=${PYTHON:-python3}
MAX_MIB=${MAX_MIB:-40}
DEST=.whl
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
download() {   # one requirement, py3.12 x86_64 binary, into $DEST
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$DEST" "$1"
}

grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p "$DEST"
rm -f "$DEST"/flashinfer_python-*.whl "$DEST"/apache_tvm_ffi-*.whl    # one version of each (two stop the install)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$TMP" 'flashinfer-python>=0.7,<0.8'
FULL=$(ls "$TMP"/flashinfer_python-*.whl)
echo "downloaded $(basename "$FULL") ($(du -m "$FULL" | cut -f1) MB)"
TVM_REQ=$(unzip -p "$FULL" '*.dist-info/METADATA' | sed -n 's/^Requires-Dist: \(apache-tvm-ffi[^;]*\)$/\1/p' | head -1)
echo "flashinfer's Requires-Dist:"
unzip -p "$FULL" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' | sed 's/^/    /'
download "${TVM_REQ:-apache-tvm-ffi}"

"$PY" - "$FULL" "$DEST" <<'EOF'
"""Strip the flashinfer wheel (see the shell header) and write it, RECORD rewritten, into DEST."""
import ast
import base64
import hashlib
import os
import posixpath
import sys
import zipfile

full, dest = sys.argv[1:3]
src = zipfile.ZipFile(full)
names = [i.filename for i in src.infolist() if not i.is_dir()]
present = set(names)
SEEDS = ["flashinfer/__init__.py", "flashinfer/decode.py", "flashinfer/prefill.py", "flashinfer/page.py"]
SEEDS += [n for n in names if n.startswith("flashinfer/jit/") and n.endswith(".py")]
DATA_KEEP = ("flashinfer/data/include/", "flashinfer/data/cccl/", "flashinfer/data/cutlass/include/",
             "flashinfer/data/cutlass/tools/util/include/", "flashinfer/data/spdlog/")
SOURCE_EXT = (".cu", ".cuh", ".c", ".cc", ".cpp", ".h", ".hpp", ".md")


def module_file(mod):
    """Wheel path of module ``mod`` (``a.b``), or None."""
    base = mod.replace(".", "/")
    for p in (base + ".py", base + "/__init__.py"):
        if p in present:
            return p
    return None


def imports(path):
    """Every flashinfer module ``path`` can import (any level, function bodies included), parents first."""
    pkg = path[:-3].replace("/", ".")
    pkg = pkg[:-len(".__init__")] if pkg.endswith(".__init__") else pkg.rpartition(".")[0]
    try:
        tree = ast.parse(src.read(path))
    except SyntaxError:
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            mods = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for m in mods:
            if m.startswith("flashinfer"):
                parts = m.split(".")
                out += [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return out


keep, todo = set(), list(SEEDS)
while todo:
    p = todo.pop()
    if p in keep:
        continue
    keep.add(p)
    todo += [f for f in map(module_file, imports(p)) if f and f not in keep]
py_dirs = {posixpath.dirname(p) for p in keep}
for n in names:
    top = n.split("/")[0]
    if top.endswith(".dist-info") and not n.endswith("/RECORD"):
        keep.add(n)
    elif n.startswith("flashinfer/data/"):
        rest = n[len("flashinfer/data/"):]
        if n.startswith(DATA_KEEP) or (rest.startswith("csrc/") and rest.count("/") == 1) or "/" not in rest:
            keep.add(n)
    elif posixpath.dirname(n) in py_dirs and not n.endswith(SOURCE_EXT) and not n.endswith(".py"):
        keep.add(n)                                      # a kept package's data (json configs, py.typed)

out_path = os.path.join(dest, os.path.basename(full))
record_name = next(n for n in names if n.endswith(".dist-info/RECORD"))
rows = []
with zipfile.ZipFile(out_path, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as out:
    for info in src.infolist():
        if info.filename not in keep:
            continue
        data = src.read(info)
        out.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append(f"{info.filename},sha256={digest},{len(data)}")
    rows.append(f"{record_name},,")
    out.writestr(record_name, "\n".join(rows) + "\n")
py = sum(1 for n in keep if n.endswith(".py"))
print(f"stripped: kept {len(keep)} of {len(names)} files ({py} Python modules), "
      f"{os.path.getsize(out_path) / 2**20:.1f} MiB (from {os.path.getsize(full) / 2**20:.1f} MiB)")
EOF

"$PY" -m zipfile -t "$DEST"/flashinfer_python-*.whl >/dev/null
echo "wheels in $DEST:"
ls -l "$DEST"/*.whl | awk '{printf "    %7.2f MiB  %s\n", $5 / 1048576, $9}'
TOTAL=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
TRACKED=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
printf 'total %.1f MiB of wheels; with the tracked tree %.1f MiB (the device limit is 64 MiB)\n' \
  "$(echo "$TOTAL / 1048576" | bc -l)" "$(echo "($TOTAL + $TRACKED) / 1048576" | bc -l)"
if [ "$TOTAL" -gt $((MAX_MIB * 1048576)) ]; then
  echo "pack_flashinfer: wheels total $TOTAL bytes, over MAX_MIB=$MAX_MIB MiB" >&2
  exit 1
fi
# the wheels install as the device command will install them (py3.12 tags; no import: this Python may differ)
"$PY" -m pip install -q --no-index --no-deps --no-compile --target "$TMP/site" --python-version 3.12 \
  --implementation cp --only-binary=:all: "${PLATFORMS[@]}" "$DEST"/*.whl
echo "pip --target install of $DEST/*.whl: OK ($(du -sm "$TMP/site" | cut -f1) MB installed)"
echo "on the device machine (carry $DEST), begin the command with:"
echo "    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site" \
  "$DEST/*.whl && export PYTHONPATH=/tmp/site:\$PWD || exit;"
