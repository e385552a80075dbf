{{- define "rlkube.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "rlkube.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "rlkube.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "rlkube.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "rlkube.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/*
Least privilege, no Secrets. Why each rule:
- rljobs: Kopf watches them and patches its finalizer + bookkeeping annotations (rlkube.io/...).
- rljobs/status: the operator writes phase/conditions. It also lets the operator create each RLJob's
  Role granting get/patch on that one RLJob's status (RBAC allows granting only what one holds, so
  neither `escalate` nor `bind` is needed).
- rljobs/finalizers: ownerReferences with blockOwnerDeletion on children.
- rayjobs: server-side apply (create/patch); delete is never needed (GC does it).
- rayclusters, pods: read-only, for status. events: read Warnings, create our own.
- configmaps, serviceaccounts, roles, rolebindings: the per-RLJob children, applied server-side.
*/}}
{{- define "rlkube.rules" -}}
- apiGroups: ["rlkube.io"]
  resources: ["rljobs"]
  verbs: ["get", "list", "watch", "patch", "update"]
- apiGroups: ["rlkube.io"]
  resources: ["rljobs/status"]
  verbs: ["get", "patch", "update"]
- apiGroups: ["rlkube.io"]
  resources: ["rljobs/finalizers"]
  verbs: ["update"]
- apiGroups: ["ray.io"]
  resources: ["rayjobs"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["ray.io"]
  resources: ["rayclusters"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: [""]
  resources: ["configmaps", "serviceaccounts"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "watch", "create", "patch"]
{{- end -}}

{{- define "rlkube.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
