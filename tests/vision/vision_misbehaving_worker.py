"""Stand-ins for the video decoder child that misbehave on purpose (used by test_vision_video.py).

    python vision_misbehaving_worker.py segfault   -> dies by SIGSEGV, like FFmpeg on some truncated H.264
    python vision_misbehaving_worker.py hang       -> never answers
    python vision_misbehaving_worker.py garbage    -> answers half a message, then exits
"""

import os
import signal
import sys
import time

sys.stdin.readline()
mode = sys.argv[1]
if mode == "segfault":
    os.kill(os.getpid(), signal.SIGSEGV)
elif mode == "hang":
    time.sleep(60)
elif mode == "garbage":
    sys.stdout.buffer.write(b"\x00\x00\x10\x00{\"type\":")
    sys.stdout.flush()
