"""The smallest use of the package; the isolation test runs it from the installed wheel."""

import llmsys.template_package as tp

print("ok", tp.__version__)
