"""When waiting requests come in: the admission policy of `Scheduler` (a mixin), kept apart from the planning of steps.

`schedule()` asks `_count_admission()` once per planned step, `schedule_decode_step()` `_admission()` once per plan;
the engine asks `admission_due()` whether a step may start the pipeline. State (set up by `Scheduler.__init__`):
`admission_batch`, `admission_max_wait`, `_withheld_steps`, `_short_of_blocks`, `watermark_blocks`, and the queues.

* Batches (`Engine(admission_batch=, admission_max_wait=)`): while requests run, waiting ones are admitted when
  `admission_batch` sequences fit at once (or every waiting one does), or after `admission_max_wait` steps in a row
  left room unused; an idle engine admits at once. Why: a step that prefills beside running decodes leaves the CUDA
  graph and the pipeline (about ten decode steps of host time on an H100), so the default with CUDA graphs is
  `max_num_seqs // 8` (`hf_paged.engine.defaults`), 1 without. Decode steps in between stay pipelined. A saturated
  llama-1b engine (1,000 Alpaca-like requests) ran 2.1-2.8x faster, with a shorter time to first token
  (`benchmarks/results/h100_2026-11-26i/`, call h). Only steps that plan something count towards
  `admission_max_wait`: a `schedule_decode_step` that finds no room is planned again by `schedule()`.
* Places and blocks: a batch is due only when its prompts' first chunks (up to `max_num_batched_tokens` each, prefix
  hits not counted) also fit the free blocks with the watermark; otherwise the step counts as withheld, so
  `admission_max_wait` still bounds the wait. A pool-bound backlog used to admit a request or two whenever a few
  blocks came free, each time in a step off the fast path (llama-1b, 1,000 Alpaca-like requests, 256 MiB pool, H100:
  2.48-2.63 s against 4.34-5.67 s, same results, call e).
* Pool-bound backlogs: when the head of `waiting` is found short of blocks (`_short_of_blocks`: the group and the
  free blocks its try needed, watermark included), no admission is due until the pool has that many free again or
  the head changes, whatever `admission_batch`: such steps would admit nobody, and a due admission keeps the engine
  off the pipelined path. An idle engine still admits at once (llama-1b, 1,000 ShareGPT-like requests, 2 GiB pool,
  H100: 9.9-10.6 s against 12.1-12.9 s, `benchmarks/results/h100_2026-11-26j/`, call d).
"""

from __future__ import annotations

__all__ = ["AdmissionPolicy"]


class AdmissionPolicy:
    """Mixed into `Scheduler`: whether this step admits waiting groups."""

    def admission_due(self) -> bool:
        """Whether this step should admit waiting groups (False when none waits).

        Why batch admissions: a step that prefills new prompts beside the running decodes leaves the engine's fast
        path (CUDA graphs, pipelining), and on a GPU it costs about ten decode steps of host time whatever the
        number of prompts (llama-1b on an H100: ~25 ms against ~2.5 ms). Admitting each request as soon as one
        finishes turns a saturated engine's every step into such a step. So with `admission_batch` = k > 1, while
        requests run, waiting ones come in when k sequences (or every waiting one, if fewer) fit `max_num_seqs` and
        their first prompt chunks fit the free blocks (prefix hits not counted), or after `admission_max_wait` steps
        in a row left room unused; an idle engine admits at once. TGI's router batches its prefills the same way
        (`waiting_served_ratio`, `max_waiting_tokens`).

        Nor is admission due while the group at the head of the queue is known not to fit the pool: the last try
        found it short of blocks, and the pool has not freed as many as that try needed since (a pool-bound
        backlog). Such steps would admit nobody, and a due admission keeps the pipelined engine off its fast path.
        """
        return self._admission()[0]

    def _admission(self) -> tuple[bool, bool]:
        """(admission due, room withheld from waiting groups this step), from one look at the queues."""
        if not self.waiting:
            return False, False
        if not self.running:
            return True, False
        short = self._short_of_blocks
        if short is not None:  # the head of the queue did not fit the pool: it cannot come in before blocks free up
            if short[0] is self.waiting[0] and self.block_manager.gpu.num_free < short[1]:
                return False, False
            self._short_of_blocks = None
        if self.admission_batch <= 1:
            return True, False
        free = self.max_num_seqs - self.num_running_seqs()
        if free <= 0:
            return False, False
        want = count = 0
        for group in self.waiting:
            want += group.max_running_seqs()
            count += 1
            if want >= self.admission_batch:
                break
        fits = free >= min(want, self.admission_batch) and self._blocks_fit(want, count)
        due = fits or self._withheld_steps >= self.admission_max_wait
        return due, not due

    def _blocks_fit(self, want: int, count: int) -> bool:
        """Whether the first chunks of the first `count` waiting groups' prompts (at most `want` sequences) fit the
        free blocks, watermark kept (prefix hits not counted). An ample pool answers without a look at each."""
        bm = self.block_manager
        room = bm.gpu.num_free - self.watermark_blocks
        chunk = self.max_num_batched_tokens
        if room >= want * bm.blocks_for(chunk):
            return True
        need = sum(bm.blocks_for(min(seq.num_uncomputed, chunk)) for group in self.waiting[:count]
                   for seq in group.live_seqs())
        return need <= room

    def _count_admission(self) -> bool:
        """`admission_due()` for the step being planned, counting the steps that withhold room from waiting groups."""
        due, withheld = self._admission()
        self._withheld_steps = self._withheld_steps + 1 if withheld else 0
        return due
