{{/* Names, labels and small computed values shared by the templates. */}}

{{- define "qk.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "qk.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "qk.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "qk.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component: include "qk.selectorLabels" (list . "controller") */}}
{{- define "qk.selectorLabels" -}}
{{- $ := index . 0 -}}
app.kubernetes.io/name: {{ include "qk.name" $ }}
app.kubernetes.io/instance: {{ $.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "qk.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "qk.controller.name" -}}
{{- printf "%s-controller" (include "qk.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "qk.controller.serviceAccountName" -}}
{{- if .Values.controller.serviceAccount.create -}}
{{- default (include "qk.controller.name" .) .Values.controller.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.controller.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "qk.node.name" -}}
{{- printf "%s-node" (include "qk.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "qk.node.serviceAccountName" -}}
{{- if .Values.nodeAgent.serviceAccount.create -}}
{{- default (include "qk.node.name" .) .Values.nodeAgent.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.nodeAgent.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The node agent's NodeConfiguration file. */}}
{{- define "qk.node.config" -}}
{{- $cfg := deepCopy .Values.nodeAgent.config -}}
{{- $_ := set $cfg "apiVersion" "qemu-kubelet.io/v1alpha1" -}}
{{- $_ := set $cfg "kind" "NodeConfiguration" -}}
{{- $_ := set $cfg "stateDir" .Values.nodeAgent.stateDir -}}
{{- $_ := set $cfg "vmUser" (dict "uid" (int .Values.nodeAgent.vmUser.uid) "gid" (int .Values.nodeAgent.vmUser.gid)) -}}
{{- if .Values.nodeAgent.keepVMs.enabled -}}
{{- $_ := set $cfg "vmCgroup" (dict "mode" "Own" "root" "/sys/fs/cgroup" "parent" .Values.nodeAgent.keepVMs.cgroupParent "namespace" "/proc/1/ns/cgroup") -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* Cross-field checks the JSON schema cannot express. */}}
{{- define "qk.validate" -}}
{{- if and .Values.controller.enabled (gt (int .Values.controller.replicas) 1) (not .Values.controller.leaderElection.enabled) -}}
{{- fail (printf "controller.replicas is %d: more than one replica needs controller.leaderElection.enabled=true" (int .Values.controller.replicas)) -}}
{{- end -}}
{{- if and .Values.monitoring.podMonitor.enabled (not (and .Values.nodeAgent.enabled .Values.nodeAgent.metrics.enabled)) -}}
{{- fail "monitoring.podMonitor.enabled scrapes the node agents: it needs nodeAgent.enabled=true and nodeAgent.metrics.enabled=true" -}}
{{- end -}}
{{- if and .Values.monitoring.serviceMonitor.enabled (not .Values.controller.enabled) -}}
{{- fail "monitoring.serviceMonitor.enabled scrapes the controller: it needs controller.enabled=true" -}}
{{- end -}}
{{- if and .Values.nodeAgent.enabled (hasKey .Values.nodeAgent.config "stateDir") -}}
{{- fail "nodeAgent.config.stateDir: set nodeAgent.stateDir instead (the chart mounts it from the host)" -}}
{{- end -}}
{{- if and .Values.nodeAgent.enabled (hasKey .Values.nodeAgent.config "vmCgroup") -}}
{{- fail "nodeAgent.config.vmCgroup: set nodeAgent.keepVMs instead (the chart sets vmCgroup with the host PID namespace and cgroup mount it needs)" -}}
{{- end -}}
{{- if and .Values.nodeAgent.enabled (hasKey .Values.nodeAgent.config "vmUser") -}}
{{- fail "nodeAgent.config.vmUser: set nodeAgent.vmUser instead (the chart grants the agent the capabilities it needs)" -}}
{{- end -}}
{{- if and .Values.nodeAgent.enabled (hasKey .Values.nodeAgent.config "nodeName") -}}
{{- fail "nodeAgent.config.nodeName: each host gets <nodeAgent.nodeNamePrefix><host node name>; set nodeAgent.nodeNamePrefix instead" -}}
{{- end -}}
{{- end -}}
