# Sourced (POSIX sh) by the Dockerfiles' install step: points pip at the optional build secrets, which
# exist only while that step runs (RUN --mount=type=secret), so nothing of them stays in the image.
#   /run/secrets/pip.conf    -> PIP_CONFIG_FILE (read after pip's own configuration files)
#   /run/secrets/ca-bundle   -> PIP_CERT (pip's CA bundle for every index it reaches)
if [ -s /run/secrets/pip.conf ]; then
    export PIP_CONFIG_FILE=/run/secrets/pip.conf
    echo "[build-secrets] pip configuration: the pip.conf build secret" >&2
fi
if [ -s /run/secrets/ca-bundle ]; then
    export PIP_CERT=/run/secrets/ca-bundle
    echo "[build-secrets] pip CA bundle: the ca-bundle build secret" >&2
fi
