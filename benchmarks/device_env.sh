# Sourced by the device scripts (from the repository root): install the wheels carried in
# .whl/ (pytest-asyncio, immutables, pytest-rerunfailures: pyproject.toml's addopts ask for
# --reruns) into /tmp/site, and put the checkout and them on PYTHONPATH. Sets OUT to a
# temporary folder when the caller has none.
OUT=${OUT:-$(mktemp -d)}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "wheel install failed"
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
