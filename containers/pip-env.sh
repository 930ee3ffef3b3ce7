# Sourced by the image's pip steps (containers/base.Dockerfile). The package index and
# its CA arrive as build secrets, files under /run/secrets that exist only during the
# RUN step that mounts them: nothing here ends up in a layer, a build arg or the image's
# environment. Any of them may be absent (then pip's defaults: PyPI, the system CAs).
#   pip.conf             a whole pip configuration file (PIP_CONFIG_FILE)
#   pip_index_url        one line: the index URL, credentials included if any
#   pip_extra_index_url  one line: extra index URLs, space-separated
#   pip_cert             a CA bundle for TLS to the index (PIP_CERT)
if [ -s /run/secrets/pip.conf ]; then export PIP_CONFIG_FILE=/run/secrets/pip.conf; fi
if [ -s /run/secrets/pip_index_url ]; then PIP_INDEX_URL="$(cat /run/secrets/pip_index_url)"; export PIP_INDEX_URL; fi
if [ -s /run/secrets/pip_extra_index_url ]; then
  PIP_EXTRA_INDEX_URL="$(cat /run/secrets/pip_extra_index_url)"; export PIP_EXTRA_INDEX_URL
fi
if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_ROOT_USER_ACTION=ignore
