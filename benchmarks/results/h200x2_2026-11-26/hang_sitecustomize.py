import faulthandler
import os

_s = int(os.environ.get("HANG_DUMP_S", "0"))
if _s:
    _f = open(f"/tmp/hangdump/{os.environ.get('HANG_TAG', 'x')}_r{os.environ.get('RANK', 's')}_{os.getpid()}.txt", "w")
    faulthandler.dump_traceback_later(_s, exit=True, file=_f)
