"""The two-thread test with the recordings' capture mode set to the first argument ("global": the eleventh
session's)."""
import sys

import pytest

import hf_paged.runner.recording as recording

recording.CAPTURE_ERROR_MODE = sys.argv[1] if len(sys.argv) > 1 else "global"
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-p", "no:logging", "-x", "tests/test_ragged_graphs.py::"
                      "test_an_engine_records_its_graphs_while_another_serves_in_another_thread"]))
