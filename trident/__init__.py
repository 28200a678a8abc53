"""trident: GPT pretraining with data, tensor and pipeline parallelism in plain PyTorch."""

from pathlib import Path as _Path

# The repository keeps parallel/ and models/ at its top level; the wheel and the editable install map them
# to trident.parallel and trident.models. When the checkout itself comes first on sys.path (``python
# train.py`` run from the repo root after a plain ``pip install .``), this directory is imported as
# ``trident`` without those subpackages inside, so let it find them beside it.
_checkout = _Path(__file__).resolve().parent.parent
if not (_Path(__file__).parent / "parallel").is_dir() and (_checkout / "parallel" / "topology.py").is_file():
    __path__.append(str(_checkout))
