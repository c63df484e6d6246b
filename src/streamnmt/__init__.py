"""streamnmt: Transformer neural machine translation training whose loop keeps the GPU busy."""

import time as _time

__version__ = "0.1.0"
# When this package was first imported (Unix time): the command's start where its process was made
# long before (a shell that exec'd `streamnmt train` at the end of `bash -c "pip install ... && ..."`).
IMPORTED_AT = _time.time()
