"""Run a script with the scheduler's block-aware admission batches (BLOCKS=1, the library) or with batches counted in
`max_num_seqs` places only (BLOCKS=0, as at 62b7525). Scratch A/B wrapper."""
import os
import runpy
import sys

from hf_paged.core import scheduler as sched_mod

if os.environ.get("BLOCKS", "1") == "0":
    def places_only(self):
        if not self.waiting:
            return False, False
        if not self.running:
            return True, False
        short = self._short_of_blocks
        if short is not None:
            if short[0] is self.waiting[0] and self.block_manager.gpu.num_free < short[1]:
                return False, False
            self._short_of_blocks = None
        if self.admission_batch <= 1:
            return True, False
        free = self.max_num_seqs - self.num_running_seqs()
        if free <= 0:
            return False, False
        want = 0
        for group in self.waiting:
            want += group.max_running_seqs()
            if want >= self.admission_batch:
                break
        due = free >= min(want, self.admission_batch) or self._withheld_steps >= self.admission_max_wait
        return due, not due

    sched_mod.Scheduler._admission = places_only
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
