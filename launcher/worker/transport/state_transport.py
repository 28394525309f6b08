"""State transport: moves a rank's training state from healthy replicas to the
ranks behind, over the epoch's communicator (torchft's CheckpointTransport is
the shape: the recovery sequence only says who sends what to whom).

Per receiver, every message a point-to-point of raw bytes (no pickle):

1. META, from the source of part 0: a fixed-size message holding a header (version,
   lengths, the CRC of the rest) and the JSON skeletons of state and aux, so the
   receiver waits for one message before every other receive is in flight. A
   skeleton too long for it sends its tail as META2.
2. The bulk, cut by `layout` from the skeleton alone, alike on both sides: the
   state's large tensors (64 KB or more) laid end to end, and its small ones packed a
   run per dtype and shape (`small_runs`, each tensor at a 64-byte offset), are each
   split into the byte slices that the plan's `Transfer.part`/`parts` name
   (`slice_bounds`), one per source, all sources at once, and into 4 MB pieces (so
   checksums overlap the wire). Large tensors go straight from the source tensor's
   storage into the tensor handed back; small ones are packed once per source
   (`Source`, even before the replay: `prepare`, while the epoch's groups form) and
   handed back as views of their packed bytes. The aux (RNG, extra) rides with part 0,
   its small tensors batched and copied out (torch's RNG setters ignore a view's
   offset). A receiver that offers its own live state
   (`receive_into`: a spare's built model, a rank's optimizer state) gets each large
   host tensor of the same path, dtype and shape written in place: no second
   allocation, no fresh pages, no copy into the model afterwards (a cut-off replay
   closes its receives first: `finalize`). A large tensor with no live home takes
   memory the spare touched while it waited, if it has some of that dtype and shape
   (`landing`), before any fresh allocation.
3. SUMS, per slice: the checksum of each of its messages, computed by the source
   while they are on the wire; the receiver checksums each message as it lands,
   while the rest are in flight. Nothing is handed back unless every sum matches.
   With the job's data key (host memory; `mac`), each "checksum" is a Poly1305 tag under
   a key of that message alone, and META carries one too, checked before it is parsed:
   bytes from anyone without the key are damaged, never loaded.
"""

from __future__ import annotations

import contextlib
import gc
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple, Protocol

import torch

from launcher.worker.replica_map import Transfer, slice_bounds
from launcher.worker.transport.codec import (
    ALIGN,
    MAX_TENSOR_BYTES,
    Run,
    Spec,
    aligned,
    assemble,
    byte_view,
    checksum,
    encode,
    live_matches,
    pack_plan,
    pack_runs,
    parse,
    run_view,
)
from launcher.worker.transport.landing_pool import LandingPool
from launcher.worker.transport.mac import REPLAY_META, REPLAY_PART, TAG_WORDS, Mac
from launcher.worker.transport.page_prefault import populate, populate_ahead

VERSION = 4  # of the wire layout below; 3 batched small tensors per slice, 2 one by one, 1 was one flat buffer
SMALL = 64 << 10  # tensors under this are batched
CHUNK = 4 << 20  # largest message: a large tensor is cut into pieces of this
META_CAP = 64 << 10  # META's fixed size: a few hundred tensors' skeleton
_HEADER = 64  # 8 int64: crc (of the rest), version, the skeletons' lengths, the packed bytes, flags, tag
_AHEAD = 1  # flag: the source sends what it prepared while the groups formed (`prepare`)
_TAG_AT = 48  # the last two words: with a data key, META's tag (over the header before it and the skeletons)
META_TAG, META2_TAG = 1, 2
_PART_SHIFT = 20  # tag of message j of slice p: ((p + 1) << 20) + j; the slice's SUMS: the last tag


@dataclass(frozen=True)
class Received:
    state: dict[str, Any]
    aux: dict[str, Any]
    nbytes: int
    sources: list[int]
    seconds: float
    damaged: tuple[int, ...] = ()  # sources whose bytes failed their checksum (the state is not usable)
    in_place: int = 0  # bytes written straight into the receiver's live tensors (`receive_into`)
    landed: int = 0  # bytes received into memory the spare touched while it waited (`landing`)
    ahead: bool = False  # the primary source sent what it had prepared while the groups formed


class StateTransport(Protocol):
    def exchange(
        self,
        plan: list[Transfer],
        me: int,
        snapshot: Callable[[], tuple[dict[str, Any], dict[str, Any]]],
        receive_into: Callable[[], Any] | None = None,
        prepared: Source | None = None,
    ) -> Received | None:
        """Send what `plan` asks of `me` and receive what it gives `me`."""


# ---- the layout: which bytes travel in which message -------------------------------------
PACKED = -1  # Piece.tensor of the bytes of the state's small tensors, packed by runs


class Piece(NamedTuple):
    """Bytes [lo, hi) of a large tensor, sent from and received into its own storage, or
    of the state's small tensors packed (`tensor` = PACKED)."""

    tensor: int  # in skeleton order (the state's, then the aux's)
    lo: int
    hi: int


class Message(NamedTuple):
    nbytes: int
    piece: Piece | None  # a large tensor's bytes, or the packed small ones', or
    runs: tuple[Run, ...]  # a batch of the aux's small ones


class Layout(NamedTuple):
    parts: list[list[Message]]  # the messages of each slice
    runs: list[Run]  # where the state's small tensors sit in their packed bytes
    packed: int  # how many bytes those are


def small_runs(specs: Sequence[Spec], n_state: int) -> tuple[list[Run], int]:
    """The state's small tensors packed a run per Spec (codec.pack_plan): one buffer, the
    same whatever the slices, so that a source packs it once, even ahead of the replay."""
    index = [i for i in range(n_state) if 0 < specs[i].nbytes < SMALL]
    runs, n = pack_plan([specs[i] for i in index])
    return [Run(r.spec, r.at, tuple(index[j] for j in r.indices)) for r in runs], n


def layout(specs: Sequence[Spec], n_state: int, parts: int, small: tuple[list[Run], int] | None = None) -> Layout:
    """The messages of each slice `part` of `parts`, from every tensor's Spec (the state's
    `n_state` first): what sources and receiver compute alike. The state's large tensors,
    laid end to end, and its small ones' packed bytes are each cut at the slice bounds
    (moved down to ALIGN) and into CHUNKs; the aux goes with slice 0 (its large tensors
    whole, its small ones batched). `small`: `small_runs` of these Specs, if known."""
    runs, packed = small if small is not None else small_runs(specs, n_state)
    total = sum(s.nbytes for s in specs[:n_state] if s.nbytes >= SMALL)
    bounds = [slice_bounds(total, p, parts) for p in range(parts)]
    small_aux: dict[Spec, list[int]] = {}
    # The packed bytes lead each slice: a receiver posts their receives from META's header
    # alone, before it has parsed the skeletons.
    out = [_pieces(PACKED, *packed_span(packed, q, parts)) for q in range(parts)]
    off = 0  # of the state's large tensors laid end to end
    for i, spec in enumerate(specs):
        n = spec.nbytes
        state = i < n_state
        if n >= SMALL:
            whole = not state or parts == 1
            spans = (
                [(0, 0, n)] if whole else [(q, _cut(a - off, n), _cut(b - off, n)) for q, (a, b) in enumerate(bounds)]
            )
            for q, lo, hi in spans:
                out[q] += _pieces(i, lo, hi)
            if state:
                off += n
        elif n and not state:
            small_aux.setdefault(spec, []).append(i)
    out[0] += _batches(small_aux)
    return Layout(out, runs, packed)


def packed_span(packed: int, part: int, parts: int) -> tuple[int, int]:
    """Slice `part`'s bytes of the `packed` bytes of small tensors (bounds moved down to ALIGN)."""
    a, b = slice_bounds(packed, part, parts)
    return _cut(a, packed), _cut(b, packed)


def _pieces(tensor: int, lo: int, hi: int) -> list[Message]:
    if 0 < hi - lo <= CHUNK:  # the common case, kept cheap: one message
        return [Message(hi - lo, Piece(tensor, lo, hi), ())]
    return [Message(min(CHUNK, hi - c), Piece(tensor, c, min(c + CHUNK, hi)), ()) for c in range(lo, hi, CHUNK)]


def _cut(x: int, n: int) -> int:
    """A slice bound inside a tensor of n bytes, moved down to an ALIGN-ed offset (so that
    every piece starts aligned: memcpy's fast path, and the GPU checksum's int64 view)."""
    return 0 if x <= 0 else n if x >= n else x - x % ALIGN


def _batches(by_spec: dict[Spec, list[int]]) -> list[Message]:
    """Runs of one Spec each, packed into messages of at most CHUNK bytes (a run that does
    not fit is cut in two)."""
    out: list[Message] = []
    runs: list[Run] = []
    end = 0
    for spec, indices in by_spec.items():
        stride = aligned(spec.nbytes)
        assert stride <= CHUNK, "a small tensor is smaller than a batch"
        start = 0
        while start < len(indices):
            room = (CHUNK - end) // stride
            if room == 0:  # full: close this batch (a run always holds one: stride <= SMALL)
                out.append(Message(end, None, tuple(runs)))
                runs, end = [], 0
                continue
            take = tuple(indices[start : start + room])
            runs.append(Run(spec, end, take))
            end += stride * len(take)
            start += len(take)
    if runs:
        out.append(Message(end, None, tuple(runs)))
    return out


def _tag(part: int, j: int) -> int:
    if j >= (1 << _PART_SHIFT) - 1:
        raise ValueError(f"replay slice {part} needs more than {(1 << _PART_SHIFT) - 2} messages")
    return ((part + 1) << _PART_SHIFT) + j


def _sums_tag(part: int) -> int:
    return ((part + 2) << _PART_SHIFT) - 1


_gc_lock = threading.Lock()
_gc_pausers = 0  # exchanges under way in this process
_gc_paused_was = [True]  # whether the GC was on when the first of them began


@contextlib.contextmanager
def gc_paused() -> Any:
    """Python's cyclic GC off for a bounded burst of allocations (a replay makes thousands
    of small objects: skeletons, views, works) and on again after the last of the
    overlapping bursts, if it was on. In a trainer that holds torch and a model, a
    collection the burst triggers walks every live object (py-spy of a 64 MB replay:
    ~6 ms of its ~60 in `gc_collect_main`). Reference counting frees everything not in a
    cycle meanwhile."""
    global _gc_pausers
    with _gc_lock:
        if _gc_pausers == 0:
            _gc_paused_was[0] = gc.isenabled()
            gc.disable()
        _gc_pausers += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pausers -= 1
            if _gc_pausers == 0 and _gc_paused_was[0]:
                gc.enable()


# ---- waiting ------------------------------------------------------------------------------
class _InOrder:
    """Several works waited as one, in order, by whichever thread waits on it (the epoch-
    watching wait runs one helper thread per work it is given); `then(i)` runs as work i
    completes, while the later ones are still in flight."""

    def __init__(self, works: list[Any], then: Callable[[int], None] | None = None, keep: Any = None) -> None:
        self.works, self.then = works, then
        self.keep = keep  # buffers that must outlive the works
        self._done = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        for i, w in enumerate(self.works):
            w.wait()
            if self.then is not None:
                self.then(i)
        self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done

    def is_success(self) -> bool:
        return self._done


def finalize(works: list[Any]) -> None:
    """Make every posted receive final: after this none writes its memory any more. A
    failed or cut-off wait does not cancel a gloo receive, nor does aborting its group
    (its bytes land whenever they come); but a wait that times out closes every
    connection of its group (gloo's Context::signalException), after which nothing lands,
    not even a message half read. So one short wait on each: a landed or failed receive
    returns or raises at once, a posted one times out and takes the connections of its
    group (the abandoned epoch's) with it."""
    for w in works:
        try:
            w.wait(timedelta(milliseconds=1))
        except Exception:
            pass


# ---- the transport ------------------------------------------------------------------------
class P2PTransport:
    """Point-to-point over a backend group; `wait(work)` waits while watching
    for a newer epoch (and raises out of the exchange when one comes)."""

    def __init__(
        self,
        pg: Any,
        device: torch.device,
        wait: Callable[[Any], None],
        landing: LandingPool | None = None,
        mac: Mac | None = None,
        names: tuple[int, ...] = (),
    ) -> None:
        """`mac`: every message carries a tag under the job's data key instead of a CRC
        (host memory only); `names`: what makes this exchange's message keys its own, alike
        on both sides (the epoch and the replay's number in it: a key signs one message)."""
        self.pg, self.device, self.wait, self.landing = pg, device, wait, landing
        self.mac, self.names = mac, names

    def digest(self, w: torch.Tensor, kind: int, src: int, *where: int) -> list[int]:
        """A message's CRC, or its tag under the data key (TAG_WORDS values)."""
        if self.mac is None:
            return [checksum(w)]
        return list(self.mac.tag([w], kind, *self.names, src, *where))

    @property
    def width(self) -> int:
        return TAG_WORDS if self.mac is not None else 1

    def exchange(
        self,
        plan: list[Transfer],
        me: int,
        snapshot: Callable[[], tuple[dict[str, Any], dict[str, Any]]],
        receive_into: Callable[[], Any] | None = None,
        prepared: Source | None = None,
    ) -> Received | None:
        """`receive_into`: called once if `me` receives, before any byte lands; returns the
        live state whose tensors may be overwritten in place (whatever it returns is in
        an unknown state if the exchange does not complete). `prepared`: what `me` sends,
        walked and packed ahead (`prepare`; the caller checked it is `unchanged`), instead
        of `snapshot()`."""
        sends = sorted((t for t in plan if t.src == me), key=lambda t: (t.dst, t.part))
        recvs = sorted((t for t in plan if t.dst == me), key=lambda t: t.part)
        assert not (sends and recvs and receive_into is not None), "plan_replay never has a rank send and receive"
        with gc_paused():
            src = (prepared or Source(*snapshot(), self.device)) if sends else None
            sent = _Sender(self, me, src).post(sends) if src is not None else None
            got = self._receive(recvs, receive_into) if recvs else None
            if sent is not None:
                self.wait(sent)
        return got

    def _receive(self, recvs: list[Transfer], receive_into: Callable[[], Any] | None = None) -> Received:
        t0 = time.monotonic()
        primary, parts = recvs[0].src, recvs[0].parts
        if [t.part for t in recvs] != list(range(parts)):
            raise ValueError(f"replay plan gives this rank slices {[t.part for t in recvs]} of {parts}")
        sources = [t.src for t in recvs]
        head = self._recv_meta(primary)
        if head is None:  # nothing more can be matched: the source's sends fail at its group's timeout
            return Received({}, {}, 0, sources, time.monotonic() - t0, (primary,))
        meta, n_skel, n_askel, n_packed, flags, meta_ok = head
        wires: list[tuple[int, int, torch.Tensor]] = []  # (part, message, bytes) in posting order
        # On gloo (receives matched by tag, not by order) the small tensors' packed bytes,
        # which lead every slice and whose size META's header says, are received while the
        # skeletons are parsed.
        early = _Early(self, recvs, n_packed) if meta_ok and self.device.type == "cpu" else None
        works: list[Any] = early.works if early is not None else []
        live: dict[int, torch.Tensor] = {}
        waiting = False
        try:
            if early is not None:
                wires += early.wires
            parsed = self._parse_meta(meta, n_skel, n_askel)
            if parsed is None:
                raise _Unreadable()
            skel, askel, specs, n_state = parsed
            lay = layout(specs, n_state, parts)
            if early is not None and lay.packed != n_packed:
                raise _Unreadable()
            msgs = lay.parts
            # In place on the host only: on NCCL an aborted receive kernel is not known
            # (measured on no GPU) to have stopped before the next write into the same memory.
            if receive_into is not None and self.device.type == "cpu":
                live = in_place(skel, specs[:n_state], receive_into(), self.device)
            into = _Destination(specs, self.device, lay, live, self.landing, early.packed if early else None)
            posted = len(wires)
            fresh: list[tuple[int, int, torch.Tensor]] = []  # of them, those into memory never touched
            for t in recvs:
                for j, m in enumerate(msgs[t.part]):
                    if early is not None and m.piece is not None and m.piece.tensor == PACKED:
                        continue  # posted already
                    wires.append((t.part, j, into.wire(m)))
                    if m.piece is None or (m.piece.tensor not in live and m.piece.tensor not in into.landed):
                        fresh.append(wires[-1])
            # Fresh pages faulted in ahead of the bytes, in the order they land: the parts'
            # messages interleaved, as their sources send them at once.
            populate_ahead([w for _, _, w in sorted(fresh, key=lambda x: (x[1], x[0]))])
            works += [self.pg.recv([w], recvs[p].src, _tag(p, j)) for p, j, w in wires[posted:]]
            k = self.width
            sums = [torch.empty(k * len(msgs[t.part]), dtype=torch.int64, device=self.device) for t in recvs]
            works += [self.pg.recv([s], t.src, _sums_tag(t.part)) for t, s in zip(recvs, sums) if s.numel()]
            mine: dict[tuple[int, int], list[int]] = {}

            def check(i: int) -> None:  # in the waiting thread, as message i lands
                if i < len(wires):
                    p, j, w = wires[i]
                    mine[(p, j)] = self.digest(w, REPLAY_PART, recvs[p].src, p, j)

            # In host memory the views need no data: build the state while the bytes flow.
            views = into.tensors() if self.device.type == "cpu" else None
            built = assemble(skel, views[:n_state]) if views is not None else None
            waiting = True
            self.wait(_InOrder(works, check))
        except BaseException as e:
            # Cut off (a newer epoch, a dead source), or refused before the wait: live tensors
            # may be half written and a receive still posted would go on writing them or
            # the buffers dropped here. Return only once none can: a receive its source is
            # sending (nothing was waited yet) is let land, any other is made final.
            if not waiting and works:
                try:
                    self.wait(_InOrder(works))
                except BaseException:
                    finalize(works)
            elif waiting and (live or early is not None):
                finalize(works)
            if isinstance(e, _Unreadable):
                return Received({}, {}, 0, sources, time.monotonic() - t0, (primary,))
            raise
        damaged = set() if meta_ok else {primary}
        for t, s in zip(recvs, sums):
            if s.numel() and s.cpu().tolist() != [x for j in range(s.numel() // k) for x in mine[(t.part, j)]]:
                damaged.add(t.src)
        n = sum(s.nbytes for s in specs) + n_skel + n_askel
        if damaged:
            return Received({}, {}, n, sources, time.monotonic() - t0, tuple(sorted(damaged)))
        views = views if views is not None else into.tensors()
        state = built if built is not None else assemble(skel, views[:n_state])
        aux = assemble(askel, [into.own(i, t) for i, t in enumerate(views[n_state:], n_state)])
        done = sum(specs[i].nbytes for i in live)
        landed = sum(specs[i].nbytes for i in into.landed)
        ahead = bool(flags & _AHEAD)
        return Received(state, aux, n, sources, time.monotonic() - t0, in_place=done, landed=landed, ahead=ahead)

    def _recv_meta(self, primary: int) -> tuple[torch.Tensor, int, int, int, int, bool] | None:
        """-> (META's bytes, its two skeletons' lengths, the packed small tensors' bytes, its
        flags, whether its checksum matched), or None when it is not META at all (another
        version, lengths out of bounds, or without the job's tag under a data key)."""
        meta = torch.empty(META_CAP, dtype=torch.uint8, device=self.device)
        self.wait(self.pg.recv([meta], primary, META_TAG))
        crc, version, n_skel, n_askel, n_packed, flags = (int(x) for x in meta[:_HEADER].view(torch.int64)[:6].tolist())
        length = _HEADER + n_skel + n_askel
        if version != VERSION or min(n_skel, n_askel) < 0 or length > (1 << 31):
            return None
        if length > META_CAP:
            tail = torch.empty(length - META_CAP, dtype=torch.uint8, device=self.device)
            self.wait(self.pg.recv([tail], primary, META2_TAG))
            meta = torch.cat([meta, tail])
        ok = checksum(meta[8:length]) == crc
        if self.mac is not None:
            signed = [meta[8:_TAG_AT], meta[_HEADER:length]]
            tag = [int(x) for x in meta[_TAG_AT:_HEADER].view(torch.int64).tolist()]
            if tag != list(self.mac.tag(signed, REPLAY_META, *self.names, primary)):
                return None  # not from a rank of this job: never parsed (it could ask for any allocation)
        if ok and (not 0 <= n_packed <= MAX_TENSOR_BYTES or n_packed % ALIGN):
            return None  # checked, yet no state packs so: what its source sends cannot be laid out
        return meta[:length], n_skel, n_askel, n_packed, flags, ok

    @staticmethod
    def _parse_meta(meta: torch.Tensor, n_skel: int, n_askel: int) -> tuple[Any, Any, list[Spec], int] | None:
        """-> (state skeleton, aux skeleton, every tensor's Spec, how many are the state's),
        or None if it cannot be parsed. One whose checksum failed is still parsed, so that
        what follows is drained."""
        body = meta[_HEADER : _HEADER + n_skel + n_askel].cpu().numpy().tobytes()
        try:
            skel, specs = parse(body[:n_skel])
            askel, aspecs = parse(body[n_skel:])
        except (ValueError, KeyError, TypeError):
            return None
        return skel, askel, specs + aspecs, len(specs)


class _Unreadable(Exception):
    """META checked out but cannot be laid out: its source is damaged, nothing is handed back."""


class _Early:
    """The receives of the small tensors' packed bytes, posted from META's header alone,
    before the skeletons are parsed, into pages faulted in first (the bytes already wait).
    Posted on this thread: a gloo receive may return only once its bytes are in (the
    pair's lock is held while they are read), and a helper thread to post them, measured
    on 2 cores, made the replay slower (4.1-4.6 against 3.0-3.4 ms at 2.65 MB)."""

    def __init__(self, tr: P2PTransport, recvs: list[Transfer], n_packed: int) -> None:
        self.packed = torch.empty(n_packed, dtype=torch.uint8, device=tr.device)
        parts = recvs[0].parts
        src = {t.part: t.src for t in recvs}
        self.wires = [
            (t.part, j, self.packed[m.piece.lo : m.piece.hi])
            for t in recvs
            for j, m in enumerate(_pieces(PACKED, *packed_span(n_packed, t.part, parts)))
            if m.piece is not None
        ]
        populate([self.packed])
        self.works = [tr.pg.recv([w], src[p], _tag(p, j)) for p, j, w in self.wires]


class Source:
    """A source's state walked once (skeletons, tensors, Specs) and its small tensors packed
    once, whatever slices and receivers it is asked for. `prepare` makes one ahead of the
    replay (while the epoch's groups form): used only if `unchanged`."""

    def __init__(self, state: dict[str, Any], aux: dict[str, Any], device: torch.device) -> None:
        self.skel, ts, specs = encode(state)
        self.askel, ta, aspecs = encode(aux)
        self.device = device
        self.n_state = len(ts)
        self.tensors = ts + ta
        self.specs = specs + aspecs
        self.runs, self.n_packed = small_runs(self.specs, self.n_state)
        self._packed: torch.Tensor | None = None
        self._marks: list[tuple[int, int]] = []
        self._token: Any = None
        self._token_of: Callable[[], Any] | None = None
        self._held: Any = None

    def packed(self) -> torch.Tensor:
        """The state's small tensors packed by runs (codec.pack_runs: gaps zeroed)."""
        if self._packed is None:
            buf = torch.empty(self.n_packed, dtype=torch.uint8, device=self.device)
            pack_runs(self.tensors, self.runs, buf)
            self._packed = buf
        return self._packed

    @property
    def ahead(self) -> bool:
        """Made by `prepare`, ahead of the replay."""
        return self._token_of is not None

    def unchanged(self) -> bool:
        """Whether the state is still what was walked and packed: no tensor walked was
        written in place (torch bumps a tensor's version at every in-place write: a
        `copy_`, an optimizer's foreach update), and the caller's token is the same. A
        tensor replaced (a load of the optimizer's state, `p.data = ...`) or written
        through `.data` leaves the walked one's version as it was: the token must change
        with whatever replaces tensors (TrainState counts its restores and steps)."""
        if self._token_of is None or self._token_of() != self._token:
            return False
        return all((t._version, t.data_ptr()) == m for t, m in zip(self.tensors, self._marks, strict=True))


def prepare(
    snapshot: Callable[[], tuple[dict[str, Any], dict[str, Any]]], device: torch.device, token: Callable[[], Any]
) -> Source:
    """A source's side made ahead of a replay it may send: the state taken and walked, and,
    in host memory, its small tensors packed (on a GPU that would queue kernels behind
    the old communicator's while it aborts). Off the replay's critical path; what a
    recovery writes before the replay (a roll forward, a rollback) makes it `unchanged()`
    no more, and the replay walks the state again. Raises RuntimeError for tensors that
    keep no version (inference tensors)."""
    state, aux = snapshot()
    src = Source(state, aux, device)
    src._token_of, src._token = token, token()
    src._held = aux  # the token may name it by id: kept alive, so that no other object takes that id
    src._marks = [(t._version, t.data_ptr()) for t in src.tensors]
    if device.type == "cpu" and all(t.device.type == "cpu" for t in src.tensors):
        src.packed()
    return src


class _Sender:
    """One source's side of an exchange: every slice it owes (to one or several receivers),
    from one Source; a slice owed twice is checksummed once."""

    def __init__(self, tr: P2PTransport, me: int, src: Source) -> None:
        self.tr, self.me, self.src = tr, me, src
        self.meta = self._meta(src.skel, src.askel)
        self._layouts: dict[int, Layout] = {}
        self._raw: dict[int, torch.Tensor] = {}  # large tensors' bytes
        self._bufs: dict[tuple[Run, ...], torch.Tensor] = {}  # the aux's batches
        self._sums: dict[tuple[int, int], torch.Tensor] = {}
        self.works: list[Any] = []

    def _meta(self, skel: bytes, askel: bytes) -> torch.Tensor:
        # Built in Python: a torch fill of 64 KB may wake a thread pool, ms on a busy host.
        n = _HEADER + len(skel) + len(askel)
        raw = bytearray(max(n, META_CAP))
        flags = _AHEAD if self.src.ahead else 0
        struct.pack_into("<5q", raw, 8, VERSION, len(skel), len(askel), self.src.n_packed, flags)
        raw[_HEADER:n] = skel + askel
        mac = self.tr.mac
        if mac is not None:
            signed = [bytes(raw[8:_TAG_AT]), bytes(raw[_HEADER:n])]
            struct.pack_into("<2q", raw, _TAG_AT, *mac.tag(signed, REPLAY_META, *self.tr.names, self.me))
        m = torch.frombuffer(raw, dtype=torch.uint8).to(self.tr.device)
        m[:8] = torch.tensor([checksum(m[8:n])], dtype=torch.int64).view(torch.uint8).to(self.tr.device)
        return m

    def _layout(self, parts: int) -> list[list[Message]]:
        if parts not in self._layouts:
            src = self.src
            self._layouts[parts] = layout(src.specs, src.n_state, parts, (src.runs, src.n_packed))
        return self._layouts[parts].parts

    def _wire(self, parts: int, part: int, j: int) -> torch.Tensor:
        m = self._layout(parts)[part][j]
        dev = self.tr.device
        if m.piece is not None and m.piece.tensor == PACKED:
            return self.src.packed()[m.piece.lo : m.piece.hi]
        if m.piece is not None:  # straight from the tensor's storage (moved only if elsewhere)
            i = m.piece.tensor
            if i not in self._raw:
                t = self.src.tensors[i]
                self._raw[i] = byte_view(t if t.device == dev else t.to(dev))
            return self._raw[i][m.piece.lo : m.piece.hi]
        if m.runs not in self._bufs:
            buf = torch.empty(m.nbytes, dtype=torch.uint8, device=dev)
            pack_runs(self.src.tensors, m.runs, buf)
            self._bufs[m.runs] = buf
        return self._bufs[m.runs]

    def post(self, sends: list[Transfer]) -> _InOrder:
        """Post META first (the receiver waits for it), then every message; checksum them
        while they are on the wire and post the sums. -> the works, waited on as one."""
        pg = self.tr.pg
        for t in sends:
            if t.part == 0:
                self.works.append(pg.send([self.meta[:META_CAP]], t.dst, META_TAG))
                if self.meta.numel() > META_CAP:
                    self.works.append(pg.send([self.meta[META_CAP:]], t.dst, META2_TAG))
        wires: dict[tuple[int, int, int], torch.Tensor] = {}
        for t in sends:
            for j in range(len(self._layout(t.parts)[t.part])):
                w = wires[(t.parts, t.part, j)] = self._wire(t.parts, t.part, j)
                self.works.append(pg.send([w], t.dst, _tag(t.part, j)))
        for t in sends:
            key = (t.parts, t.part)
            if key not in self._sums:
                n = len(self._layout(t.parts)[t.part])
                sums = [
                    x
                    for j in range(n)
                    for x in self.tr.digest(wires[(t.parts, t.part, j)], REPLAY_PART, self.me, t.part, j)
                ]
                self._sums[key] = torch.tensor(sums, dtype=torch.int64).to(self.tr.device)
            if self._sums[key].numel():
                self.works.append(pg.send([self._sums[key]], t.dst, _sums_tag(t.part)))
        return _InOrder(self.works, keep=(wires, self.meta, self._sums))


class _Destination:
    """The receiver's tensors: large ones allocated whole and filled piece by piece, the
    state's small ones views of their packed bytes (the optimizer and `copy_` take any
    view). The aux's small ones (RNG states) get storage of their own: torch's RNG
    setters read a view's storage from its start, not from the view's offset. On a GPU
    the small ones (counters, RNG) are handed back in host memory, as those setters expect.
    A large tensor goes, in this order, into the live tensor `live` names, into one
    `landing` holds for its dtype and shape (`landed`: their indices), or into new memory."""

    def __init__(
        self,
        specs: list[Spec],
        device: torch.device,
        lay: Layout,
        live: dict[int, torch.Tensor] | None = None,
        landing: LandingPool | None = None,
        packed: torch.Tensor | None = None,
    ) -> None:
        """`packed`: where the small tensors' packed bytes are received (posted already)."""
        self.specs, self.device, self.runs = specs, device, lay.runs
        live = live or {}
        self.landed: set[int] = set()
        self.out: list[torch.Tensor | None] = []
        for i, s in enumerate(specs):
            t = live.get(i)
            if t is None and s.nbytes >= SMALL and landing is not None:
                t = landing.take(s.dtype, s.shape, device)
                if t is not None:
                    self.landed.add(i)
            if t is None and (s.nbytes >= SMALL or s.nbytes == 0):
                t = torch.empty(s.shape, dtype=s.dtype, device=device)
            self.out.append(t)
        self.packed = packed if packed is not None else torch.empty(lay.packed, dtype=torch.uint8, device=device)
        self.batches: list[tuple[Message, torch.Tensor]] = []

    def wire(self, m: Message) -> torch.Tensor:
        if m.piece is not None and m.piece.tensor == PACKED:
            return self.packed[m.piece.lo : m.piece.hi]
        if m.piece is not None:
            t = self.out[m.piece.tensor]
            assert t is not None
            return byte_view(t)[m.piece.lo : m.piece.hi]
        buf = torch.empty(m.nbytes, dtype=torch.uint8, device=self.device)
        self.batches.append((m, buf))
        return buf

    def own(self, i: int, t: torch.Tensor) -> torch.Tensor:
        """Tensor i with storage of its own (a copy if it is a view of a batch): once landed."""
        return t if self.out[i] is not None else t.clone()

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor, small ones as views of their bytes: on a GPU only once those have
        landed (they are copied to the host), else at once (no data is read)."""
        out = list(self.out)
        for runs, buf in [(self.runs, self.packed), *((m.runs, b) for m, b in self.batches)]:
            host = buf.cpu()
            for r in runs:
                for i, v in zip(r.indices, run_view(host, r).unbind(0)):
                    out[i] = v
        missing = [i for i, t in enumerate(out) if t is None]
        if missing:
            raise ValueError(f"replay layout left tensors {missing[:5]} unfilled")
        return [t for t in out if t is not None]


def in_place(skel: Any, specs: Sequence[Spec], live_state: Any, device: torch.device) -> dict[int, torch.Tensor]:
    """Which received tensors (index -> live tensor) can be written straight into the
    receiver's own: of those `live_matches` pairs up, a large contiguous one on `device`,
    no two sharing a byte (tied weights appear under two paths: the second gets memory of
    its own)."""
    found = [
        (t.data_ptr(), t.data_ptr() + specs[i].nbytes, i, t)  # (first byte, end, index, tensor)
        for i, t in live_matches(skel, specs, live_state).items()
        if specs[i].nbytes >= SMALL and t.device == device and t.is_contiguous()
    ]
    out: dict[int, torch.Tensor] = {}
    end = -1
    for lo, hi, i, t in sorted(found, key=lambda f: (f[0], f[2])):
        if lo >= end:  # overlaps none taken before it
            out[i], end = t, hi
    return out


def describe(r: Received) -> str:
    mb = r.nbytes / 1e6
    rate = mb / r.seconds if r.seconds > 0 else float("inf")
    where = f", {r.in_place / 1e6:.2f} MB into its live tensors" if r.in_place else ""
    if r.landed:
        where += f", {r.landed / 1e6:.2f} MB into memory warmed while it waited"
    return f"{mb:.2f} MB from ranks {r.sources} in {r.seconds:.3f}s ({rate:.0f} MB/s{where})"


__all__ = ["P2PTransport", "Received", "Source", "StateTransport", "describe", "layout", "prepare"]
