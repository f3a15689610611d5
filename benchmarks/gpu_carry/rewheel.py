"""Repack a wheel: keep the members `keep(name)` accepts, rewrite RECORD (sha256, size) to match.
usage: rewheel.py IN.whl OUT_DIR [--drop REGEX ...] [--stored]
--stored: write members uncompressed (ZIP_STORED), for an outer .tar.xz to compress better."""

import base64
import hashlib
import re
import sys
import zipfile
from pathlib import Path

args = sys.argv[1:]
src, out_dir = Path(args[0]), Path(args[1])
drops = [re.compile(args[i + 1]) for i, a in enumerate(args) if a == "--drop"]
stored = "--stored" in args
out = out_dir / src.name
with zipfile.ZipFile(src) as zin:
    names = [n for n in zin.namelist() if not any(d.search(n) for d in drops)]
    record = next(n for n in names if n.endswith(".dist-info/RECORD"))
    lines = []
    comp = zipfile.ZIP_STORED if stored else zipfile.ZIP_DEFLATED
    with zipfile.ZipFile(out, "w", comp, compresslevel=None if stored else 9) as zout:
        for n in names:
            if n == record or n.endswith("/"):
                continue
            data = zin.read(n)
            info = zin.getinfo(n)
            zi = zipfile.ZipInfo(n, info.date_time)
            zi.external_attr = info.external_attr
            zi.compress_type = comp
            zout.writestr(zi, data)
            h = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            lines.append(f"{n},sha256={h},{len(data)}")
        lines.append(f"{record},,")
        zi = zipfile.ZipInfo(record, zin.getinfo(record).date_time)
        zi.compress_type = comp
        zout.writestr(zi, "\n".join(lines) + "\n")
print(out, out.stat().st_size, f"kept {len(names)} of {len(zin.namelist())}")
