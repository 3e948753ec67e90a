"""The smallest use of the package; the isolation test runs it from the installed wheel."""

import llmsys.kernels_fused as tp

print("ok", tp.__version__)
