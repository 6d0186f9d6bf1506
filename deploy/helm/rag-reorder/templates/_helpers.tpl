{{/* Names, labels and the checks that no schema can express. */}}

{{- define "rag-reorder.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "rag-reorder.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Selector labels: the Deployment, Service, PodDisruptionBudget and ServiceMonitor all
select by exactly these, and the pod template carries them. */}}
{{- define "rag-reorder.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rag-reorder.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "rag-reorder.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "rag-reorder.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: server
{{- end }}

{{- define "rag-reorder.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "rag-reorder.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "rag-reorder.image" -}}
{{- $tag := .Values.image.tag | default (printf "%s-%s" .Chart.AppVersion .Values.image.flavor) }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{/* The Secret holding the API key: the chart's own or an existing one. */}}
{{- define "rag-reorder.apiKeySecretName" -}}
{{- .Values.apiKey.existingSecret | default (printf "%s-api-key" (include "rag-reorder.fullname" .)) }}
{{- end }}

{{- define "rag-reorder.adminApiKeySecretName" -}}
{{- .Values.adminApiKey.existingSecret | default (printf "%s-admin-api-key" (include "rag-reorder.fullname" .)) }}
{{- end }}

{{- define "rag-reorder.startupBudgetSeconds" -}}
{{- mul .Values.probes.startup.periodSeconds .Values.probes.startup.failureThreshold }}
{{- end }}

{{/* Cross-field rules, checked at render time so a bad release never reaches the cluster. */}}
{{- define "rag-reorder.validate" -}}
{{- $l := .Values.lifecycle }}
{{- /* After preStop + drain the server closes: up to 2 s for open connections (uvicorn),
then the engine, which vLLM gives 5 s before it kills the engine process (5.1 s measured from
SIGTERM to exit with nothing in flight). 10 s covers both. */}}
{{- $needed := add $l.preStopSleepSeconds (ceil $l.drainTimeoutSeconds) 10 }}
{{- if lt (int $l.terminationGracePeriodSeconds) (int $needed) }}
{{- fail (printf "lifecycle.terminationGracePeriodSeconds (%v) must be at least preStopSleepSeconds + drainTimeoutSeconds + 10 s to close (%v)" $l.terminationGracePeriodSeconds $needed) }}
{{- end }}
{{- if and .Values.apiKey.enabled (not .Values.apiKey.existingSecret) (not .Values.apiKey.value) }}
{{- fail "apiKey.enabled needs apiKey.existingSecret or apiKey.value" }}
{{- end }}
{{- if and .Values.adminApiKey.enabled (not .Values.adminApiKey.existingSecret) (not .Values.adminApiKey.value) }}
{{- fail "adminApiKey.enabled needs adminApiKey.existingSecret or adminApiKey.value" }}
{{- end }}
{{- if and .Values.model.download.enabled (not (and .Values.model.volume.enabled .Values.model.volume.hfCache)) }}
{{- fail "model.download needs model.volume.enabled and model.volume.hfCache (it fills that Hugging Face cache)" }}
{{- end }}
{{- if and .Values.model.download.enabled (not (or .Values.model.download.repo .Values.model.name)) }}
{{- fail "model.download needs model.download.repo or model.name (a hub id)" }}
{{- end }}
{{- if and .Values.model.volume.enabled (not .Values.model.volume.existingClaim) }}
{{- fail "model.volume.enabled needs model.volume.existingClaim" }}
{{- end }}
{{- if and .Values.biasProfiles.volume.enabled (not .Values.biasProfiles.volume.existingClaim) }}
{{- fail "biasProfiles.volume.enabled needs biasProfiles.volume.existingClaim" }}
{{- end }}
{{- if and .Values.biasProfiles.volume.enabled (hasKey .Values.settings "BIAS_PROFILE_DIR") }}
{{- fail "settings.BIAS_PROFILE_DIR and biasProfiles.volume both set the profile folder; keep one" }}
{{- end }}
{{- if and .Values.biasProfiles.volume.enabled (hasKey .Values.settings "TRAFFIC_SAMPLE_DIR") }}
{{- fail "settings.TRAFFIC_SAMPLE_DIR and biasProfiles.volume both set the traffic sample folder; keep one" }}
{{- end }}
{{- if and .Values.podDisruptionBudget.enabled (eq (toString .Values.podDisruptionBudget.maxUnavailable) "<nil>") (eq (toString .Values.podDisruptionBudget.minAvailable) "<nil>") }}
{{- fail "podDisruptionBudget needs maxUnavailable or minAvailable" }}
{{- end }}
{{- if and .Values.autoscaling.enabled (gt (int .Values.autoscaling.minReplicas) (int .Values.autoscaling.maxReplicas)) }}
{{- fail "autoscaling.minReplicas must not exceed autoscaling.maxReplicas" }}
{{- end }}
{{- if and .Values.progressDeadlineSeconds (le (int .Values.progressDeadlineSeconds) (int (include "rag-reorder.startupBudgetSeconds" .))) }}
{{- fail "progressDeadlineSeconds must exceed the startup probe budget (periodSeconds x failureThreshold)" }}
{{- end }}
{{- end }}
