"""Real long documents with no download: the Python source files this machine already has.

Documents: the .py files of the Python standard library (site-packages excluded) and of the
installed torch package when there is one, sorted by name, so the corpus is the same on any
machine with the same Python and torch versions. `unit` says what one document is:
- "file": one file, named by its path relative to its root ("stdlib/json/decoder.py",
  "torch/nn/modules/linear.py"); most are a few thousand bytes;
- "package": the files of one directory, joined in name order, named by the directory and a
  slash ("stdlib/json/", "torch/nn/modules/"): long documents (a median in the tens of
  thousands of bytes, the largest megabytes), as long-context training sees them.
Tokens: the document's bytes (0..255), with BOS_ID before and EOS_ID after.

Split, by a fixed rule on the name alone: a document is held out when
sha256(name) mod 20 == 0 (about 5% of the documents); training never sees a held-out document.

Packing (`DocumentPacker`): documents are streamed in an order shuffled per epoch from the seed,
and cut into batches of exactly tokens_per_batch tokens. A document that does not fit in what is
left of a batch is split: its first part ends this batch, its rest starts the next (a document
longer than a batch spans several). Each part is its own sequence in cu_seqlens (positions
restart at 0, nothing attends across parts), and its last token has no target (label -100):
every other token's label is the next byte of the same document. When an epoch's documents run
out mid-batch, the batch is completed from the next epoch's order: every training batch is full,
none is padded. The held-out set (`heldout_batches`) is the held-out documents in name order,
packed the same way, the first `count` batches (the last one may be shorter when the held-out
documents run out; it is never padded).
"""
from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor

from nsa.models.lm import BOS_ID, EOS_ID

HELDOUT_MODULUS = 20


DOCUMENT_UNITS = ("file", "package")


@dataclass(frozen=True)
class Document:
    name: str  # root/relative path: the identity the split rule hashes
    paths: tuple[Path, ...]  # its files, in name order

    def tokens(self) -> Tensor:
        """(len + 2,) int64: BOS, the files' bytes one after another, EOS."""
        data = b"".join(path.read_bytes() for path in self.paths)
        body = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)
        return torch.cat([torch.tensor([BOS_ID]), body, torch.tensor([EOS_ID])])


def is_heldout(name: str) -> bool:
    digest = hashlib.sha256(name.encode()).digest()
    return int.from_bytes(digest[:8], "little") % HELDOUT_MODULUS == 0


def source_roots(include_torch: bool = True) -> dict[str, Path]:
    """{root name: directory}: the standard library, and torch's package directory if any."""
    roots = {"stdlib": Path(sysconfig.get_paths()["stdlib"])}
    if include_torch:
        roots["torch"] = Path(torch.__file__).resolve().parent
    return roots


def find_documents(roots: dict[str, Path] | None = None, *, unit: str = "file",
                   max_documents: int | None = None) -> list[Document]:
    """The documents of every non-empty .py file under the roots (site-packages skipped: its
    contents differ from machine to machine), one per file or per directory (`unit`, see the
    module docstring), sorted by name; the first max_documents when given."""
    if unit not in DOCUMENT_UNITS:
        raise ValueError(f"unit must be one of {DOCUMENT_UNITS}, got {unit!r}")
    roots = source_roots() if roots is None else roots
    files: dict[str, list[tuple[str, Path]]] = {}
    for root_name, root in sorted(roots.items()):
        for path in root.rglob("*.py"):
            relative = path.relative_to(root)
            if "site-packages" in relative.parts or "__pycache__" in relative.parts:
                continue
            if path.is_file() and path.stat().st_size > 0:
                name = f"{root_name}/{relative.as_posix()}"
                key = name if unit == "file" else name[:name.rindex("/") + 1]
                files.setdefault(key, []).append((name, path))
    documents = [Document(key, tuple(path for _, path in sorted(members)))
                 for key, members in files.items()]
    documents.sort(key=lambda d: d.name)
    return documents[:max_documents]


def split_documents(documents: list[Document]) -> tuple[list[Document], list[Document]]:
    """(train, heldout) by the fixed hash rule."""
    train = [d for d in documents if not is_heldout(d.name)]
    heldout = [d for d in documents if is_heldout(d.name)]
    return train, heldout


@dataclass
class PackedBatch:
    input_ids: Tensor       # (T,) int64
    labels: Tensor          # (T,) int64: next token of the same piece, -100 at a piece's end
    cu_seqlens: Tensor      # (S+1,) int32
    host_cu_seqlens: tuple[int, ...]
    max_seqlen: int

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_targets(self) -> int:
        return int((self.labels != -100).sum())

    def to(self, device: torch.device) -> "PackedBatch":
        return PackedBatch(self.input_ids.to(device, non_blocking=True),
                           self.labels.to(device, non_blocking=True),
                           self.cu_seqlens.to(device, non_blocking=True), self.host_cu_seqlens,
                           self.max_seqlen)

    def model_inputs(self) -> dict:
        return dict(cu_seqlens=self.cu_seqlens, host_cu_seqlens=self.host_cu_seqlens,
                    max_seqlen=self.max_seqlen)

    def padded_to_multiple(self, multiple: int) -> "PackedBatch":
        """This batch with a filler document appended (token 0, no targets: it adds nothing to
        the loss and, a document of its own, is seen by no other) so that its tokens are a
        multiple of `multiple` (context-parallel shards must be equal); itself when they are.
        Call it before `to`: the bounds are built on the host."""
        extra = -self.num_tokens % multiple
        if extra == 0:
            return self
        bounds = (*self.host_cu_seqlens, self.host_cu_seqlens[-1] + extra)
        return PackedBatch(torch.cat([self.input_ids, self.input_ids.new_zeros(extra)]),
                           torch.cat([self.labels, self.labels.new_full((extra,), -100)]),
                           torch.tensor(bounds, dtype=torch.int32), bounds,
                           max(self.max_seqlen, extra))


def pack_pieces(pieces: list[Tensor]) -> PackedBatch:
    lengths = [len(p) for p in pieces]
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    labels = torch.cat([torch.cat([p[1:], torch.tensor([-100])]) for p in pieces])
    return PackedBatch(torch.cat(pieces), labels, torch.tensor(bounds, dtype=torch.int32),
                       tuple(bounds), max(lengths))


class DocumentPacker:
    """Batches of exactly tokens_per_batch tokens from documents (see the module docstring).

    shuffle=True: a new order each epoch, from torch.Generator(seed + epoch), so two runs with
    one seed see the same tokens in the same order. shuffle=False: name order, one epoch
    (`epochs=1`) or repeated.
    """

    def __init__(self, documents: list[Document], tokens_per_batch: int, *, seed: int = 0,
                 shuffle: bool = True, epochs: int | None = None):
        if not documents:
            raise ValueError("documents: the corpus is empty")
        if tokens_per_batch < 2:
            raise ValueError(f"tokens_per_batch must be >= 2, got {tokens_per_batch}")
        self.documents = documents
        self.tokens_per_batch = tokens_per_batch
        self.seed, self.shuffle, self.epochs = seed, shuffle, epochs

    def _document_stream(self) -> Iterator[Tensor]:
        epoch = 0
        while self.epochs is None or epoch < self.epochs:
            order = list(range(len(self.documents)))
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + epoch)
                order = torch.randperm(len(order), generator=generator).tolist()
            for index in order:
                yield self.documents[index].tokens()
            epoch += 1

    def __iter__(self) -> Iterator[PackedBatch]:
        pieces, room = [], self.tokens_per_batch
        for tokens in self._document_stream():
            while len(tokens):
                piece, tokens = tokens[:room], tokens[room:]
                pieces.append(piece)
                room -= len(piece)
                if room == 0:
                    yield pack_pieces(pieces)
                    pieces, room = [], self.tokens_per_batch
        if pieces:  # finite stream only: the documents ran out mid-batch
            yield pack_pieces(pieces)


def heldout_batches(documents: list[Document], tokens_per_batch: int,
                    count: int) -> list[PackedBatch]:
    """The first `count` batches of the held-out documents in name order (a fixed set)."""
    batches = []
    for batch in DocumentPacker(documents, tokens_per_batch, shuffle=False, epochs=1):
        batches.append(batch)
        if len(batches) == count:
            break
    return batches
