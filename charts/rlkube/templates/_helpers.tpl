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
The operator's rules in a served namespace (a Role in namespaced mode, the ClusterRole in cluster mode).
Least privilege: no Secrets, no escalate/bind, no update, delete only to undo its own refused attempt.
Each verb is used; docs/operator.md has the table and tests/chart proves it against the operator's own
request log.
- rljobs: Kopf lists/watches them and patches its finalizer + bookkeeping annotations.
- rljobs/status: phase/conditions (merge patch). Also what each RLJob's runtime Role grants (patch on
  that RLJob's status), which RBAC lets the operator grant because it holds it.
- rljobs/finalizers update: children's ownerReferences set blockOwnerDeletion, which the
  OwnerReferencesPermissionEnforcement admission plugin checks where it is enabled.
- rayjobs and the per-RLJob configmaps, serviceaccounts, roles, rolebindings: get (the ownership check
  before any write), create + patch (server-side apply), list/watch (the watch cache). delete on the
  four kinds created before the RayJob: when the API server refuses a later child, the ones this
  attempt created are deleted again (uid-preconditioned; the operator guard allows deleting only
  RLJob-owned objects).
- rayclusters, pods: read-only (list/watch) for status. events: Warning events are watched, our own
  are created.
*/}}
{{- define "rlkube.rules" -}}
- apiGroups: ["rlkube.io"]
  resources: ["rljobs"]
  verbs: ["list", "watch", "patch"]
- apiGroups: ["rlkube.io"]
  resources: ["rljobs/status"]
  verbs: ["patch"]
- apiGroups: ["rlkube.io"]
  resources: ["rljobs/finalizers"]
  verbs: ["update"]
- apiGroups: ["ray.io"]
  resources: ["rayjobs"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["ray.io"]
  resources: ["rayclusters"]
  verbs: ["list", "watch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["list", "watch", "create"]
- apiGroups: [""]
  resources: ["configmaps", "serviceaccounts"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
{{- end -}}

{{/* The namespaces cluster mode never serves: the configured ones and (unless asked) our own. */}}
{{- define "rlkube.excludedNamespaces" -}}
{{- $out := .Values.clusterMode.excludeNamespaces | default list -}}
{{- if not .Values.clusterMode.includeReleaseNamespace -}}
{{- $out = append $out .Release.Namespace -}}
{{- end -}}
{{- toJson ($out | uniq) -}}
{{- end -}}

{{/* The namespaces the operator serves in namespaced mode (JSON list; empty in cluster mode). */}}
{{- define "rlkube.servedNamespaces" -}}
{{- if eq .Values.mode "cluster" -}}[]{{- else -}}{{- toJson .Values.watchNamespaces -}}{{- end -}}
{{- end -}}

{{/*
A whole policy for one namespace: every key the override (`.over`) gives replaces the default's
(`.def`); hostPath's keys one by one. Lists replace, never merge. Output: YAML.
*/}}
{{- define "rlkube.policy.merge" -}}
{{- $def := .def -}}
{{- $over := .over | default dict -}}
{{- $out := dict -}}
{{- range $k := list "serviceAccounts" "priorityClasses" "tolerationKeys" "nodeSelectorKeys" "images" "envNames" "persistentVolumeClaims" -}}
{{- $_ := set $out $k (ternary (get $over $k) (get $def $k) (hasKey $over $k)) -}}
{{- end -}}
{{- $hd := $def.hostPath | default dict -}}
{{- $ho := get $over "hostPath" | default dict -}}
{{- $hp := dict -}}
{{- range $k := list "enabled" "paths" "writablePaths" -}}
{{- $_ := set $hp $k (ternary (get $ho $k) (get $hd $k) (hasKey $ho $k)) -}}
{{- end -}}
{{- $_ := set $out "hostPath" $hp -}}
{{- toYaml $out -}}
{{- end -}}

{{/* CEL variables of one policy (`.policy`, merged) for the admission policy's validations. */}}
{{- define "rlkube.policy.variables" -}}
{{- $p := .policy -}}
- name: scope
  expression: {{ .scope | toJson | quote }}
{{- range $k := list "serviceAccounts" "priorityClasses" "tolerationKeys" "nodeSelectorKeys" "images" "envNames" }}
{{- $exact := list -}}
{{- $prefixes := list -}}
{{- range (get $p $k | default list) -}}
{{- if hasSuffix "*" . -}}
{{- $prefixes = append $prefixes (trimSuffix "*" .) -}}
{{- else -}}
{{- $exact = append $exact . -}}
{{- end -}}
{{- end }}
- name: {{ $k }}Exact
  expression: {{ toJson $exact | quote }}
- name: {{ $k }}Prefixes
  expression: {{ toJson $prefixes | quote }}
- name: {{ $k }}Text
  expression: {{ (ternary (join ", " (get $p $k | default list)) "none" (gt (len (get $p $k | default list)) 0)) | toJson | quote }}
{{- end }}
- name: persistentVolumeClaims
  expression: {{ $p.persistentVolumeClaims | toJson | quote }}
- name: hostPathEnabled
  expression: {{ $p.hostPath.enabled | toJson | quote }}
{{- range $k := list "paths" "writablePaths" }}
{{- $paths := list -}}
{{- range (get $p.hostPath $k | default list) -}}
{{- $paths = append $paths (regexReplaceAll "/+$" . "") -}}
{{- end }}
- name: hostPath{{ title $k }}
  expression: {{ toJson $paths | quote }}
- name: hostPath{{ title $k }}Text
  expression: {{ (ternary (join ", " (get $p.hostPath $k | default list)) "none" (gt (len (get $p.hostPath $k | default list)) 0)) | toJson | quote }}
{{- end }}
{{- end -}}

{{- define "rlkube.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
