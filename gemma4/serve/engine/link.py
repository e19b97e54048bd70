"""Process 0's schedule on every process: the step descriptor and the engine's link.

How the schedule reaches the other processes. Every process loads the same model onto the same
global mesh and compiles the same steps; every jitted step is then one SPMD program that all
processes must enter in the same order with the same host inputs. Process 0 alone runs the
scheduler (admission, chunking, sampling parameters, seeds). Before each dispatch — every prefill
chunk and every decode step, warm-up runs included — it broadcasts a fixed-size int32 *step
descriptor* with `multihost_utils.broadcast_one_to_all` (one small collective): the operation,
the executable's shape key (kind, size, fresh / cache length), the row, the last position, the
tokens and positions, and the sampling rows (seeds, steps, temperatures, top-k, top-p, the
repetition window and penalty; floats by bit pattern). The other processes sit in `follow`:
receive a descriptor, take their own executable for that key (compiling it first if needed), run
it on exactly those inputs, repeat. So followers never warm up or schedule on their own: they
replay process 0's sequence. A STOP descriptor (process 0's engine closing) ends them.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Protocol

import numpy as np
from jax.experimental import multihost_utils

from gemma4.model.sampling import REPETITION_WINDOW, SamplingRows
from gemma4.serve import distributed
from gemma4.serve.shape_keys import DecodeKey, PrefillKey

log = logging.getLogger("gemma4.serve.distributed")


# ------------------------------------------------------------------------------ the step descriptor
OP_STOP, OP_PREFILL, OP_DECODE = 1, 2, 3
_HEADER = 8  # op, size (bucket | width), fresh | kv_len, row, last, n tokens, n sampling rows, spare
# The SamplingRows fields sent as one int32 column each (floats by bit pattern); `recent`, the
# repetition window [rows, window], follows them.
_SAMPLING_COLUMNS = tuple(f.name for f in dataclasses.fields(SamplingRows) if f.name != "recent")


@dataclasses.dataclass(frozen=True)
class Step:
    """One dispatch: which executable (key) and its host inputs."""

    op: int
    key: PrefillKey | DecodeKey | None = None
    tokens: np.ndarray | None = None
    positions: np.ndarray | None = None
    row: int = 0
    last: int = 0
    sampling: SamplingRows | None = None


class StepRunner(Protocol):
    """What a follower replays process 0's steps through (`gemma4.serve.engine.runner.Runner`)."""

    def run_prefill(self, key: PrefillKey, tokens: np.ndarray, positions: np.ndarray, row: int, last: int,
                    sampling: SamplingRows) -> tuple[int, bool]: ...

    def run_decode(self, key: DecodeKey, tokens: np.ndarray, positions: np.ndarray, sampling: SamplingRows,
                   row: int = 0) -> tuple[np.ndarray, np.ndarray]: ...


# Each column's dtype on the host (SamplingRows.idle's), for the bit-pattern view.
_COLUMN_DTYPES = {name: np.asarray(getattr(SamplingRows.idle(1), name)).dtype for name in _SAMPLING_COLUMNS}


class StepCodec:
    """Fixed-size int32 encoding of a Step (every process must broadcast the same shape)."""

    def __init__(self, max_tokens: int, max_rows: int, window: int):
        self.max_tokens, self.max_rows, self.window = int(max_tokens), int(max_rows), int(window)
        self.size = _HEADER + 2 * self.max_tokens + self.max_rows * (len(_SAMPLING_COLUMNS) + self.window)

    def encode(self, step: Step) -> np.ndarray:
        out = np.zeros(self.size, np.int32)
        if step.op == OP_STOP:
            out[0] = OP_STOP
            return out
        size, extra = ((step.key.bucket, step.key.fresh) if isinstance(step.key, PrefillKey)
                       else (step.key.width, step.key.kv_len))
        tokens, positions = np.asarray(step.tokens, np.int32).ravel(), np.asarray(step.positions, np.int32).ravel()
        recent = np.asarray(step.sampling.recent)
        n, rows = tokens.size, recent.shape[0]
        if n > self.max_tokens or rows > self.max_rows or recent.shape[1] != self.window:
            raise ValueError(f"step {step.key} does not fit the descriptor ({n} tokens, {rows} rows)")
        out[:_HEADER] = (step.op, size, int(extra), step.row, step.last, n, rows, 0)
        t = _HEADER
        out[t:t + n], out[t + self.max_tokens:t + self.max_tokens + n] = tokens, positions
        s = _HEADER + 2 * self.max_tokens
        for i, name in enumerate(_SAMPLING_COLUMNS):
            col = np.asarray(getattr(step.sampling, name), _COLUMN_DTYPES[name]).view(np.int32)
            out[s + i * self.max_rows:s + i * self.max_rows + rows] = col
        r = s + len(_SAMPLING_COLUMNS) * self.max_rows
        out[r:r + rows * self.window] = recent.astype(np.int32).ravel()
        return out

    def decode(self, vec: np.ndarray) -> Step:
        vec = np.asarray(vec, np.int32)
        op = int(vec[0])
        if op == OP_STOP:
            return Step(OP_STOP)
        if op not in (OP_PREFILL, OP_DECODE):
            raise ValueError(f"unknown step descriptor op {op}")
        _, size, extra, row, last, n, rows, _ = (int(v) for v in vec[:_HEADER])
        t = _HEADER
        tokens = vec[t:t + n].copy()
        positions = vec[t + self.max_tokens:t + self.max_tokens + n].copy()
        s = _HEADER + 2 * self.max_tokens
        cols = {name: vec[s + i * self.max_rows:s + i * self.max_rows + rows].copy().view(_COLUMN_DTYPES[name])
                for i, name in enumerate(_SAMPLING_COLUMNS)}
        r = s + len(_SAMPLING_COLUMNS) * self.max_rows
        recent = vec[r:r + rows * self.window].reshape(rows, self.window).copy()
        sampling = SamplingRows(recent=recent, **cols)
        key = PrefillKey(size, bool(extra)) if op == OP_PREFILL else DecodeKey(size, extra)
        return Step(op, key, tokens, positions, row, last, sampling)


def _broadcast(vec: np.ndarray) -> np.ndarray:
    """One descriptor from process 0 to all. A collective that fails (gloo reports a peer's closed
    connection at once) means a process is gone: stop with that message rather than a traceback."""
    try:
        return np.asarray(multihost_utils.broadcast_one_to_all(vec))
    except Exception as e:  # noqa: BLE001
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        distributed.lost(f"a collective with the other processes failed, so one of them is gone ({first})")
        raise  # not reached: lost() exits


# ------------------------------------------------------------------------------ the runner's side
class EngineLink:
    """Process 0 announces every dispatch; the others replay them (see the module doc). The
    engine's runner owns it: `announce` is called by the runner before each of process 0's
    device calls, `follow` replays process 0's steps through the runner's own calls.

    max_tokens: the most tokens one step carries (the largest prompt bucket, or the rows);
    max_rows: the cache's rows."""

    def __init__(self, max_tokens: int, max_rows: int):
        self.leader = distributed.is_leader()
        self.codec = StepCodec(max_tokens, max_rows, REPETITION_WINDOW)
        self.stopped = False

    # process 0 --------------------------------------------------------------
    def announce(self, key: PrefillKey | DecodeKey, tokens, positions, row: int, last: int,
                 sampling: SamplingRows) -> None:
        """Before process 0 runs a step (the runner calls this): send it to the other processes."""
        if not self.leader:
            return  # a follower replays: the step came from process 0
        # the descriptor carries ids only (no embedding rows)
        if not isinstance(key, (PrefillKey, DecodeKey)) or (isinstance(key, PrefillKey) and key.embeds):
            raise ValueError(f"step {key} cannot be sent to the other processes")
        op = OP_DECODE if isinstance(key, DecodeKey) else OP_PREFILL
        host = SamplingRows(**{f.name: np.asarray(getattr(sampling, f.name)) for f in dataclasses.fields(SamplingRows)})
        _broadcast(self.codec.encode(Step(op, key, tokens, positions, int(row), int(last), host)))

    def lead(self, serve: Callable[[], None]) -> None:
        """Process 0: run the scheduler loop `serve`, then tell the others to stop."""
        try:
            serve()
        finally:
            self.stop_followers()

    def stop_followers(self) -> None:
        """Send STOP once (from the thread that dispatches steps, or after it ended)."""
        if self.leader and not self.stopped:
            self.stopped = True
            _broadcast(self.codec.encode(Step(OP_STOP)))  # the followers' loops end

    # the other processes ------------------------------------------------------
    def follow(self, runner: StepRunner) -> None:
        """The other processes: replay process 0's steps through `runner` until it says STOP."""
        while True:
            step = self.codec.decode(_broadcast(np.zeros(self.codec.size, np.int32)))
            if step.op == OP_STOP:
                log.info("process 0 stopped its engine; this follower stops too")
                distributed.goodbye()
                return
            try:
                if step.op == OP_PREFILL:
                    runner.run_prefill(step.key, step.tokens, step.positions, step.row, step.last, step.sampling)
                else:
                    runner.run_decode(step.key, step.tokens, step.positions, step.sampling, row=step.row)
            except Exception as e:  # noqa: BLE001 - process 0 would wait forever on this process
                distributed.lost(f"replaying process 0's step {step.key} failed ({type(e).__name__}: {str(e)[:300]})")
