{{/* Names: <release>-tokenrelay, or the release name alone when it already says tokenrelay. */}}
{{- define "tokenrelay.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tokenrelay.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tokenrelay.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "tokenrelay.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "tokenrelay.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* A probe: an HTTP GET of (list path port settings), with the probe's settings from values (periods,
thresholds, timeouts). */}}
{{- define "tokenrelay.probe" -}}
{{- $get := dict "httpGet" (dict "path" (index . 0) "port" (index . 1)) -}}
{{- toYaml (merge $get (deepCopy (index . 2))) -}}
{{- end -}}

{{/* A writable emptyDir on the read-only root filesystem: (list name sizeLimit); no limit when it is empty. */}}
{{- define "tokenrelay.scratch" -}}
- name: {{ index . 0 }}
  emptyDir:
    {{- with index . 1 }}
    sizeLimit: {{ . }}
    {{- else }} {}
    {{- end }}
{{- end -}}

{{/* The name of the Strimzi Kafka cluster. */}}
{{- define "tokenrelay.kafkaName" -}}
{{- .Values.kafka.strimzi.name | default (include "tokenrelay.fullname" .) | trunc 47 | trimSuffix "-" -}}
{{- end -}}

{{/* Bootstrap servers for the pods of this release (same namespace as a Strimzi cluster of it). */}}
{{- define "tokenrelay.bootstrap" -}}
{{- if .Values.kafka.strimzi.enabled -}}
{{- printf "%s-kafka-bootstrap:9092" (include "tokenrelay.kafkaName" .) -}}
{{- else -}}
{{- required "set kafka.bootstrap (HOST:PORT of an external Kafka) or kafka.strimzi.enabled" .Values.kafka.bootstrap -}}
{{- end -}}
{{- end -}}

{{/* Bootstrap servers for KEDA's operator, which runs in a namespace of its own. */}}
{{- define "tokenrelay.kedaBootstrap" -}}
{{- if .Values.kafka.strimzi.enabled -}}
{{- printf "%s-kafka-bootstrap.%s.svc:9092" (include "tokenrelay.kafkaName" .) .Release.Namespace -}}
{{- else -}}
{{- include "tokenrelay.bootstrap" . -}}
{{- end -}}
{{- end -}}

{{/* A flag's environment variable, as tokenrelay/cli.py's _env_name (and the one flag with its own). */}}
{{- define "tokenrelay.envName" -}}
{{- $flag := trimPrefix "--" (toString .) -}}
{{- if eq $flag "allowed-media-domains" -}}
ALLOWED_MEDIA_DOMAINS_ENV
{{- else -}}
{{- printf "TOKENRELAY_%s" ($flag | replace "-" "_" | upper) -}}
{{- end -}}
{{- end -}}

{{/* A value as a flag reads it: lists joined by commas; whole numbers without an exponent. */}}
{{- define "tokenrelay.envValue" -}}
{{- if kindIs "slice" . -}}
{{- join "," . -}}
{{- else if kindIs "float64" . -}}
{{- if eq (floor .) . }}{{ int64 . }}{{ else }}{{ . }}{{ end -}}
{{- else -}}
{{- . -}}
{{- end -}}
{{- end -}}

{{/* env entries from a map of flag name -> value (sorted); the id flags come from the pod's name. */}}
{{- define "tokenrelay.env" -}}
{{- range $flag, $value := . }}
- name: {{ include "tokenrelay.envName" $flag }}
{{- if and (has $flag (list "gateway-id" "worker-id")) (eq (toString $value) "<pod-name>") }}
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- else }}
  value: {{ include "tokenrelay.envValue" $value | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* --drain-timeout: what the grace period leaves after the preStop sleep, less 10 s for the HTTP
server's last 5 s and the bus to close. Takes (list grace preStopSleep). */}}
{{- define "tokenrelay.drainTimeout" -}}
{{- $left := sub (sub (int64 (index . 0)) (int64 (index . 1 | default 0))) 10 -}}
{{- if lt $left 1 -}}
{{- fail (printf "terminationGracePeriodSeconds %v leaves no time to drain: make it at least preStopSleepSeconds + 11" (index . 0)) -}}
{{- end -}}
{{- $left -}}
{{- end -}}

{{/* The gateway's flags: the chart's, then gateway.env over them. */}}
{{- define "tokenrelay.gatewayFlags" -}}
{{- $flags := dict
    "host" "0.0.0.0"
    "port" .Values.gateway.port
    "gateway-id" "<pod-name>"
    "topic-prefix" .Values.topicPrefix
    "kafka-bootstrap" (include "tokenrelay.bootstrap" .)
    "kafka-replication-factor" .Values.kafka.replicationFactor
    "drain-timeout" (include "tokenrelay.drainTimeout" (list .Values.gateway.terminationGracePeriodSeconds .Values.gateway.preStopSleepSeconds)) -}}
{{- toYaml (mergeOverwrite $flags (deepCopy (.Values.gateway.env | default dict))) -}}
{{- end -}}

{{/* A model's entry checked, with worker.* and keda.* filled in. Takes (list $ $model). */}}
{{- define "tokenrelay.model" -}}
{{- $root := index . 0 -}}
{{- $m := index . 1 -}}
{{- $w := $root.Values.worker -}}
{{- $k := $root.Values.keda -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" (toString $m.name)) -}}
{{- fail (printf "models: name %q is not a DNS label (lower-case letters, digits, '-')" (toString $m.name)) -}}
{{- end -}}
{{- if and $m.hubId $m.path -}}
{{- fail (printf "models: %s has both hubId and path; give one" $m.name) -}}
{{- end -}}
{{- if and $m.path (not $m.volume) (hasPrefix "/" (toString $m.path) | not) -}}
{{- fail (printf "models: %s: a relative path needs a volume" $m.name) -}}
{{- end -}}
{{- $served := $m.servedModelName | default $m.hubId | default $m.name -}}
{{- if kindIs "string" $served }}{{ $served = splitList "," $served }}{{ end -}}
{{- $mountPath := $m.mountPath | default "/models" -}}
{{- $flags := dict
    "worker-id" "<pod-name>"
    "topic-prefix" $root.Values.topicPrefix
    "kafka-bootstrap" (include "tokenrelay.bootstrap" $root)
    "kafka-replication-factor" $root.Values.kafka.replicationFactor
    "metrics-address" (printf "0.0.0.0:%v" $w.metricsPort)
    "drain-timeout" (include "tokenrelay.drainTimeout" (list $w.terminationGracePeriodSeconds 0))
    "served-model-name" $served -}}
{{- $size := hasKey $m "tensorParallelSize" | ternary $m.tensorParallelSize ($w.tensorParallelSize | default 1) -}}
{{- if not (regexMatch "^[0-9]+$" (toString $size)) -}}
{{- fail (printf "models: %s: tensorParallelSize %v is not a whole number" $m.name $size) -}}
{{- end -}}
{{- $size = int64 $size -}}
{{- if or (lt $size 1) (gt $size 64) -}}
{{- fail (printf "models: %s: tensorParallelSize %d is not in [1, 64]" $m.name $size) -}}
{{- end -}}
{{- if gt $size 1 }}{{ $_ := set $flags "tensor-parallel-size" $size }}{{ end -}}
{{- if $m.hubId }}{{ $_ := set $flags "model" $m.hubId }}{{ end -}}
{{- if $m.path -}}
{{- $_ := set $flags "model" (ternary $m.path (printf "%s/%s" $mountPath $m.path) (hasPrefix "/" $m.path)) -}}
{{- end -}}
{{- $flags = mergeOverwrite $flags (deepCopy ($w.env | default dict)) (deepCopy ($m.env | default dict)) -}}
{{- if ne (include "tokenrelay.envValue" (get $flags "tensor-parallel-size" | default 1)) (toString $size) -}}
{{- fail (printf "models: %s: set tensorParallelSize, not env tensor-parallel-size: it sizes the pod's GPUs and /dev/shm too" $m.name) -}}
{{- end -}}
{{/* Split across GPUs: nvidia.com/gpu is the size, requested and limited (values.yaml, worker.tensorParallelSize). */}}
{{- $resources := deepCopy (hasKey $m "resources" | ternary $m.resources $w.resources | default dict) -}}
{{- if and (gt $size 1) (ne (toString (get $flags "device")) "cpu") -}}
{{- range $kind := list "requests" "limits" -}}
{{- $amounts := get $resources $kind | default dict -}}
{{- $gpus := get $amounts "nvidia.com/gpu" -}}
{{- if and (hasKey $m "resources") $gpus (ne (toString $gpus) (toString $size)) -}}
{{- fail (printf "models: %s: resources.%s asks for nvidia.com/gpu %v, tensorParallelSize %d: one GPU per rank" $m.name $kind $gpus $size) -}}
{{- end -}}
{{- $_ := set $amounts "nvidia.com/gpu" $size -}}
{{- $_ := set $resources $kind $amounts -}}
{{- end -}}
{{- end -}}
{{- $names := get $flags "served-model-name" -}}
{{- if not (kindIs "slice" $names) }}{{ $names = splitList "," (toString $names) }}{{ end -}}
{{- $fullname := include "tokenrelay.fullname" $root -}}
name: {{ $m.name }}
deployment: {{ printf "%s-worker-%s" $fullname $m.name | trunc 63 | trimSuffix "-" }}
servedNames: {{ toJson $names }}
topicPrefix: {{ get $flags "topic-prefix" | toString | quote }}
flags: {{ toJson $flags }}
mountPath: {{ $mountPath }}
readOnly: {{ not $m.hubId }}
volume: {{ toJson ($m.volume | default dict) }}
replicas: {{ hasKey $m "replicas" | ternary $m.replicas $w.replicas }}
minReplicas: {{ hasKey $m "minReplicas" | ternary $m.minReplicas $k.minReplicas }}
maxReplicas: {{ hasKey $m "maxReplicas" | ternary $m.maxReplicas $k.maxReplicas }}
lagThreshold: {{ hasKey $m "lagThreshold" | ternary $m.lagThreshold $k.lagThreshold }}
resources: {{ toJson $resources }}
shmSize: {{ hasKey $m "shmSize" | ternary $m.shmSize (gt $size 1 | ternary $w.tensorParallelShmSize $w.shmSize) | quote }}
nodeSelector: {{ toJson (hasKey $m "nodeSelector" | ternary $m.nodeSelector $w.nodeSelector) }}
tolerations: {{ toJson (hasKey $m "tolerations" | ternary $m.tolerations $w.tolerations) }}
affinity: {{ toJson (hasKey $m "affinity" | ternary $m.affinity $w.affinity) }}
extraEnv: {{ toJson (concat ($w.extraEnv | default list) ($m.extraEnv | default list)) }}
{{- end -}}

{{/* Every model, checked: names unique. */}}
{{- define "tokenrelay.checkModels" -}}
{{- $seen := dict -}}
{{- range .Values.models -}}
{{- if hasKey $seen (toString .name) -}}
{{- fail (printf "models: %s is listed twice" .name) -}}
{{- end -}}
{{- $_ := set $seen (toString .name) true -}}
{{- end -}}
{{- end -}}

{{- define "tokenrelay.slug" -}}
{{- regexReplaceAll "[^A-Za-z0-9._-]" (toString .) "_" -}}
{{- end -}}
