"""The device's Python packages, simulated: .ci/gpu-check's CPU dry run puts this folder on PYTHONPATH.

Python imports sitecustomize at start-up, in every process the dry run
starts (pytest, serve and its engine process, the bench). From then on a
module of a distribution that is neither on the device (the image's
packages, .ci/device-image.txt, with what they need) nor carried
(.ci/device-wheels.txt) cannot be imported, as on the device: an optional
import (uvicorn's httptools, structlog's greenlet) falls back here as there,
and a needed one fails its stage here, before a device's minutes are spent.
"""

import device_packages

device_packages.install()
