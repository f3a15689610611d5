#!/bin/bash
# Build the GPU machine's carry: DEST (default .whl/ in the repository root) gets pins.txt's wheels for
# CPython 3.12 on manylinux x86_64, bitsandbytes slimmed to its CUDA 13.0 and CPU libraries (rewheel.py: its
# code and version unchanged, RECORD rewritten). Needs the package index; the GPU machine reaches none.
# Prints `carry: N MiB`, the wheels plus the tracked tree, which must stay <= 58 (the run tool's 64 MiB cap).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd); ROOT=$(cd "$HERE/../.." && pwd)
DEST=${1:-$ROOT/.whl}; DOWNLOADS=${WHL_CACHE:-$(mktemp -d)}
PINS=$(grep -v '^#' "$HERE/pins.txt" | grep -v '^docopt==')  # docopt is an sdist on PyPI: built below
mkdir -p "$DOWNLOADS" "$DEST"
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$DOWNLOADS" $PINS
DOCOPT=$(grep '^docopt==' "$HERE/pins.txt")
ls "$DOWNLOADS"/docopt-*.whl >/dev/null 2>&1 || python3 -m pip wheel -q --no-deps "$DOCOPT" -w "$DOWNLOADS"
rm -f "$DEST"/*.whl
for wheel in "$DOWNLOADS"/*.whl; do
    case $(basename "$wheel") in
        bitsandbytes-*) python3 "$HERE/rewheel.py" "$wheel" "$DEST" \
            --drop 'libbitsandbytes_(cuda(11[0-9]|12[0-9]|132)|rocm[0-9]+|xpu[0-9]+)\.so$' >/dev/null ;;
        *) cp "$wheel" "$DEST/" ;;
    esac
done
WHEELS=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
TREE=$(cd "$ROOT" && git ls-files -z | xargs -0 cat | wc -c)  # the tracked files, as the tree travels
echo "$(ls "$DEST"/*.whl | wc -l) wheels, $((WHEELS / 1048576)) MiB; the tree $((TREE / 1048576)) MiB"
echo "carry: $(((WHEELS + TREE) / 1048576)) MiB"
