"""How the speed-up caches keep their entries: pixels as lossless codebooks (`compact_pixels`,
`expand_pixels`), and the size cap with least-recently-used eviction (`CacheBudget`,
`training.cache_max_gb`). What the entries are and how they are keyed is `caches.py`'s."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open

from vlm_recipes.files import write_safetensors
from vlm_recipes.full_disk import full_disk_reason

log = logging.getLogger(__name__)

SPEEDUP_CACHE_KINDS = ("preprocessed", "vision-features")  # what training.cache_max_gb caps

# Pixels as codebooks. A float tensor of at least this many elements is stored as the indices of its values
# in a table of its distinct values, per colour channel where the layout shows the channels: lossless (the
# table holds the floats' exact bits), one byte per pixel instead of four where a channel has at most 256
# values, which is the case after any processor that resizes 8-bit images before normalizing them.
CODEBOOK_MIN_ELEMENTS = 4096
CODEBOOK_PARTS = (".codes", ".codebook", ".shape")  # `pixel_values.codes`, ...: no processor key ends so
_BITS = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def compact_pixels(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors to store: each float tensor that a codebook makes smaller as `<key>.codes` (the indices,
    [outer, channels, inner]), `<key>.codebook` (the values, [channels, n]) and `<key>.shape`."""
    stored = {}
    for key, tensor in tensors.items():
        coded = (
            _codebook(tensor) if tensor.dtype in _BITS and tensor.numel() >= CODEBOOK_MIN_ELEMENTS else None
        )
        if coded is None:
            stored[key] = tensor
        else:
            stored[f"{key}.codes"], stored[f"{key}.codebook"] = coded
            stored[f"{key}.shape"] = torch.tensor(tensor.shape, dtype=torch.int64)
    return stored


def expand_pixels(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors `compact_pixels` stored, bit for bit (dtype and shape included)."""
    tensors = {}
    for key, tensor in stored.items():
        if key.endswith(".codes"):
            name = key.removesuffix(".codes")
            book = stored[f"{name}.codebook"]
            channels, size = book.shape
            # each channel's values start at channel * size in the flattened codebook
            offsets = torch.arange(0, channels * size, size, dtype=torch.int32)[:, None]
            index = tensor.to(torch.int32).add_(offsets).reshape(-1)
            shape = stored[f"{name}.shape"].tolist()
            tensors[name] = torch.index_select(book.reshape(-1), 0, index).reshape(shape)
        elif not key.endswith(CODEBOOK_PARTS):
            tensors[key] = tensor
    return tensors


def _layouts(shape: torch.Size) -> list[tuple[int, int, int]]:
    """(outer, channels, inner) views of a pixel tensor to try, the colour channels apart first: images
    [..., 3, H, W] (SmolVLM, Gemma 3, LLaVA-OneVision), patch rows [..., 3 * T * P * P] (the Qwen line),
    then the whole tensor as one channel."""
    numel = shape.numel()
    layouts = []
    if len(shape) >= 3 and shape[-3] == 3:
        layouts.append((numel // (3 * shape[-2] * shape[-1]), 3, shape[-2] * shape[-1]))
    if shape[-1] % 3 == 0:
        layouts.append((numel // shape[-1], 3, shape[-1] // 3))
    return [*layouts, (1, 1, numel)]


def _codebook(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(codes, codebook) in the first layout whose channels have at most 256 values each (uint8 codes),
    else in the first with at most 32768 (int16 codes, where that is smaller); None: stored as is."""
    # distinct bit patterns, not floats: -0.0 stays apart from 0.0, and every NaN keeps its bits
    bits = tensor.detach().cpu().contiguous().view(_BITS[tensor.dtype])
    wide = None
    for outer, channels, inner in _layouts(tensor.shape):
        grouped = bits.reshape(outer, channels, inner)
        uniques = []
        floats = tensor.detach().cpu().contiguous().reshape(outer, channels, inner)
        for channel in range(channels):
            if (coded := _steps_of_one_value(floats[:, channel], grouped[:, channel])) is not None:
                uniques.append(coded)
                continue
            values, inverse = torch.unique(grouped[:, channel], return_inverse=True)
            if len(values) > 32768:
                break
            uniques.append((values, inverse))
        else:
            most = max(len(values) for values, _ in uniques)
            smaller = channels * most * tensor.element_size() < tensor.nbytes * 3 / 4  # the codebook's cost
            if most <= 256 and smaller:
                return _pack(uniques, torch.uint8, tensor.dtype)
            if wide is None and tensor.element_size() > 2 and smaller:
                wide = uniques
    return _pack(wide, torch.int16, tensor.dtype) if wide else None


def _steps_of_one_value(floats: torch.Tensor, bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The fast path for a channel of an 8-bit image after the processor's rescale and normalize: every value
    is lowest + k * step for an integer k < 256, so the codes are k by arithmetic (a sort-based `unique` costs
    ~4x more, a twentieth of a first-epoch vision step). (codebook bits [256], codes) as `unique` gives them,
    checked bit for bit; None where the channel is not such (the caller falls back to `unique`)."""
    flat, want = floats.reshape(-1).float(), bits.reshape(-1)
    lowest = flat.min()
    sample = torch.unique(floats.reshape(-1)[:: max(1, flat.numel() // 4096)])  # its smallest gap: the step
    step = sample.float().diff().min() if len(sample) > 1 else torch.tensor(1.0)
    if not torch.isfinite(lowest) or not step > 0 or (flat.max() - lowest) / step > 255.5:
        return None
    codes = ((flat - lowest) / step).round_().to(torch.int32)
    book = torch.zeros(256, dtype=bits.dtype)
    book[((sample.float() - lowest) / step).round_().long()] = sample.view(bits.dtype)
    missed = book.index_select(0, codes) != want  # values the sample did not hold
    if missed.any():
        book[codes[missed].long()] = want[missed]
        if not torch.equal(book.index_select(0, codes), want):  # bit for bit, or not this path
            return None
    return book, codes.reshape(bits.shape)


def _pack(uniques: list, code_dtype: torch.dtype, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.stack([inverse.to(code_dtype) for _, inverse in uniques], 1)  # [outer, channels, inner]
    book = torch.zeros(len(uniques), max(len(v) for v, _ in uniques), dtype=uniques[0][0].dtype)
    for channel, (values, _) in enumerate(uniques):
        book[channel, : len(values)] = values
    return codes, book.view(dtype)


# --------------------------------------------------------------------------- the size cap

EVICT_DOWN_TO = 0.9  # of the cap: evictions come in batches, not at every write once the cap is reached


class CacheBudget:
    """The size cap of the speed-up caches under `root` (`training.cache_max_gb`): when a write takes their
    entries past `max_bytes`, the least recently used ones are deleted, down to 90% of the cap.

    Kept cheap: the entries are listed once, at the first write, and a running total is kept from then on.
    A read marks its entry used by setting its mtime to now (atime is unreliable under relatime and
    noatime). Entries this process wrote are deleted last (only when they alone pass the cap). Writes by
    other processes (DDP ranks, another run) after the listing are counted when this process reads them,
    so several writers together can pass the cap by what they wrote meanwhile."""

    def __init__(self, root: Path, max_bytes: int, kinds: tuple[str, ...] = SPEEDUP_CACHE_KINDS):
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.kinds = kinds
        # path -> (last used, bytes); None until the first write lists the directories
        self.entries: dict[Path, tuple[float, int]] | None = None
        self.total = 0
        self.own: set[Path] = set()
        self.evicted = {kind: [0, 0] for kind in kinds}  # entries, bytes
        self.logged = dict.fromkeys(kinds, 0)
        self.warned_own = False

    def used(self, path: Path) -> None:
        """`path` was read: it is now the most recently used entry."""
        now = time.time()
        try:
            os.utime(path, (now, now))
        except OSError:
            return  # evicted meanwhile by another process, or a read-only cache
        if self.entries is None:
            return  # the listing will see the new mtime
        if path not in self.entries:  # written by another process since the listing
            size = path.stat().st_size
            self.total += size
        else:
            size = self.entries[path][1]
        self.entries[path] = (now, size)

    def written(self, path: Path) -> None:
        """`path` was just written: count it, and evict if the cap is passed."""
        if self.entries is None:
            self._list()
        previous = self.entries.get(path, (0.0, 0))[1]
        size = path.stat().st_size
        self.entries[path] = (time.time(), size)
        self.total += size - previous
        self.own.add(path)
        if self.total > self.max_bytes:
            self._evict()

    def _list(self) -> None:
        self.entries = {}
        for kind in self.kinds:
            for path in (self.root / kind).rglob("*.safetensors"):
                with contextlib.suppress(FileNotFoundError):  # evicted meanwhile by another process
                    stat = path.stat()
                    self.entries[path] = (stat.st_mtime, stat.st_size)
        self.total = sum(size for _, size in self.entries.values())

    def _evict(self) -> None:
        assert self.entries is not None
        target = self.max_bytes * EVICT_DOWN_TO
        # other runs' entries first, each group least recently used first
        for path in sorted(self.entries, key=lambda p: (p in self.own, self.entries[p][0])):
            if self.total <= target:
                break
            if path in self.own and not self.warned_own:
                self.warned_own = True
                log.warning(
                    "the speed-up caches hold more than training.cache_max_gb (%.3g GB) for this run alone: "
                    "entries it wrote are evicted and will be made again; raise training.cache_max_gb",
                    self.max_bytes / 1e9,
                )
            size = self.entries.pop(path)[1]
            self.total -= size
            self.own.discard(path)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            counts = self.evicted.setdefault(path.relative_to(self.root).parts[0], [0, 0])
            counts[0] += 1
            counts[1] += size

    def eviction_stats(self, kind: str, since: tuple[int, int]) -> dict:
        """What the cap evicted of `kind` since `since` (an earlier `evicted[kind]`), logged at info level
        the first time it is asked for (once per stage)."""
        count, size = self.evicted[kind][0] - since[0], self.evicted[kind][1] - since[1]
        if self.evicted[kind][0] > self.logged[kind]:
            self.logged[kind] = self.evicted[kind][0]
            log.info(
                "%s cache: %d least recently used entries evicted (%.2f GB) to stay under "
                "training.cache_max_gb (%.3g GB)",
                kind,
                count,
                size / 1e9,
                self.max_bytes / 1e9,
            )
        return {"evicted": count, "evicted_gb": round(size / 1e9, 4)}


DIGEST_KEY = "vlm_recipes.digest"  # in each entry's safetensors metadata: its tensors' digest


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """A digest of the tensors' names, dtypes, shapes and bytes: an entry whose bytes changed after it was
    written (a copy cut short, a network filesystem, bit rot) no longer matches it."""
    digest = hashlib.blake2b(digest_size=16)
    for key in sorted(tensors):
        tensor = tensors[key].detach().cpu().contiguous()
        digest.update(f"{key} {tensor.dtype} {tuple(tensor.shape)};".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def write_entry(path: Path, tensors: dict[str, torch.Tensor], budget: CacheBudget | None) -> None:
    """A cache entry written atomically with its digest, and counted against the cap (which may evict)."""
    write_safetensors(path, tensors, metadata={DIGEST_KEY: tensors_digest(tensors)})
    if budget is not None:
        budget.written(path)


def unwritable(directory: Path) -> str | None:
    """Why entries cannot be written under `directory` (a read-only filesystem, no permission, a full disk);
    None where they can. A probe of 64 KB is written, flushed to the disk and deleted."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".probe-") as probe:
            probe.write(bytes(65536))
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as error:
        return f"{directory}: {error.strerror or error}"
    return None


class EntryStore:
    """One speed-up cache's reads and writes. A cache is only a copy, so a fault of its disk never costs the
    run: an entry that cannot be read whole and as written (cut short, garbled, its digest wrong) is a miss,
    deleted, counted as damaged and made again; a write the disk refuses (full, read-only) turns this
    cache's writing off for the stage, with a warning, and the stage trains on reading what is there; any other
    error of a write propagates."""

    def __init__(self, kind: str, budget: CacheBudget | None):
        self.kind = kind
        self.budget = budget
        self.damaged = 0
        self.writes_off: str | None = None

    def read(self, path: Path, device: str = "cpu") -> dict[str, torch.Tensor] | None:
        """The entry's tensors; None when it is not there (not made yet, evicted) or was damaged."""
        try:
            with safe_open(str(path), framework="pt", device="cpu") as entry:
                written_digest = (entry.metadata() or {}).get(DIGEST_KEY)
                tensors = {key: entry.get_tensor(key) for key in entry.keys()}  # noqa: SIM118 (not iterable)
        except Exception as error:  # safetensors raises its own error for a short or garbled header
            if not path.exists():
                return None
            return self._damaged(path, f"unreadable: {error}")
        if written_digest != tensors_digest(tensors):
            return self._damaged(
                path, "its bytes differ from what was written" if written_digest else "no digest"
            )
        if self.budget is not None:
            self.budget.used(path)
        return {key: tensor.to(device) for key, tensor in tensors.items()} if device != "cpu" else tensors

    def write(self, path: Path, tensors: dict[str, torch.Tensor]) -> None:
        if self.writes_off is not None:
            return
        try:
            write_entry(path, tensors, self.budget)
        except Exception as error:  # any OSError (read-only, no permission), or a full disk by any writer's
            full = full_disk_reason(error, path.parent)  # error (safetensors raises its own SafetensorError)
            if not isinstance(error, OSError) and full is None:
                raise
            self.writes_off = f"{path.parent}: {full or error.strerror or error}"
            log.warning(
                "%s cache: cannot write (%s): the stage goes on without storing entries (what the cache "
                "holds is still read)",
                self.kind,
                self.writes_off,
            )

    def stats(self) -> dict:
        return {"damaged": self.damaged, **({"writes_off": self.writes_off} if self.writes_off else {})}

    def _damaged(self, path: Path, why: str) -> None:
        self.damaged += 1
        with contextlib.suppress(OSError):
            path.unlink()
        log.log(
            logging.WARNING if self.damaged == 1 else logging.DEBUG,
            "%s cache: damaged entry %s (%s): deleted, made again%s",
            self.kind,
            path,
            why,
            "" if self.damaged > 1 else " (further ones are counted in metrics.json)",
        )
