"""A worker that needs no torch: the first attempt waits (to be killed with its node), a restarted
one exits 0 at once. For the failover tests of the control plane alone."""

import os
import time

if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
    time.sleep(600)
