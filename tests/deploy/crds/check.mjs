// Validates custom resources with the validators kubernetes-models generates from the upstream
// CRDs' openAPIV3Schema (types, enums, required fields, formats). Those schemas allow unknown
// fields (the API server prunes them), so tests/deploy/schemas adds the strict field check.
// stdin: a JSON list of manifests. stdout: a JSON list, one list of error messages per manifest.
import { readFileSync } from "node:fs";
import { ScaledObject } from "@kubernetes-models/keda/keda.sh/v1alpha1/ScaledObject";
import { PrometheusRule } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PrometheusRule";
import { ServiceMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor";

const MODELS = {
  "keda.sh/v1alpha1/ScaledObject": ScaledObject,
  "monitoring.coreos.com/v1/PrometheusRule": PrometheusRule,
  "monitoring.coreos.com/v1/ServiceMonitor": ServiceMonitor,
};

const input = JSON.parse(readFileSync(0, "utf8"));
const out = input.map((doc) => {
  const Model = MODELS[`${doc.apiVersion}/${doc.kind}`];
  if (!Model) return [`no CRD validator for ${doc.apiVersion} ${doc.kind}`];
  try {
    new Model(doc).validate();
    return [];
  } catch (error) {
    return (error.errors ?? [error]).map((e) => `${e.instancePath ?? ""} ${e.message}`.trim());
  }
});
process.stdout.write(JSON.stringify(out));
