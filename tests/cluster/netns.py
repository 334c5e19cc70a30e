"""The emulated hosts of the launch tests: network namespaces on a private bridge, real shaped
links. The machinery lives in the package (``ashl.netns``, src/ashl/netns.py, with its remote
shell src/ashl/hostexec) so that ``python -m ashl.bench e2e --netns`` can use it too; this
module re-exports it under its old name."""
from ashl.netns import *  # noqa: F401,F403
from ashl.netns import (BRIDGE, HOSTEXEC, PREFIX, SUBNET, SWITCH, Hosts, address,  # noqa: F401
                        hostexec_path, hostfile, mpirun_args, skip_reason)
