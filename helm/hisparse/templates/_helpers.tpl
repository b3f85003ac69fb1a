{{/* ---------------------------------------------------------------- names and labels */}}

{{- define "hisparse.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* Resource-name prefix; 40 characters at most so KubeRay's derived names stay short. */}}
{{- define "hisparse.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "hisparse.gatewayName" -}}
{{- printf "%s-gateway" (include "hisparse.fullname" .) -}}
{{- end -}}

{{- define "hisparse.selectorLabels" -}}
app.kubernetes.io/name: {{ include "hisparse.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "hisparse.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "hisparse.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: hisparse
{{- end -}}

{{- define "hisparse.image" -}}
{{- printf "%s:%s" .Values.image.repository (toString .Values.image.tag) -}}
{{- end -}}

{{/* ---------------------------------------------------------------- numbers */}}

{{/*
Integer rendering of a number (YAML numbers reach templates as float64, and toString would
print 4e+06): "hisparse.int" 4000000 -> 4000000.
*/}}
{{- define "hisparse.int" -}}
{{- printf "%.0f" (float64 .) -}}
{{- end -}}

{{/*
A byte size (integer, or a string such as 40GiB, 512Mi, 2.5GB) -> integer bytes as a string.
The schema already restricts the spelling; the fail below guards against bypassing it.
*/}}
{{- define "hisparse.bytes" -}}
{{- $v := . -}}
{{- if or (kindIs "float64" $v) (kindIs "int64" $v) (kindIs "int" $v) -}}
{{- printf "%.0f" (float64 $v) -}}
{{- else -}}
{{- $s := toString $v | trim -}}
{{- if not (regexMatch "^[0-9]+(\\.[0-9]+)?([KMGT](i|iB|B)?|B)?$" $s) -}}
{{- fail (printf "cannot read %q as a byte size (examples: 1073741824, 40GiB, 512Mi, 2.5GB)" $s) -}}
{{- end -}}
{{- $num := regexReplaceAll "^([0-9.]+).*$" $s "${1}" -}}
{{- $unit := regexReplaceAll "^[0-9.]+" $s "" -}}
{{- $units := dict "" 1.0 "B" 1.0 "K" 1e3 "KB" 1e3 "M" 1e6 "MB" 1e6 "G" 1e9 "GB" 1e9 "T" 1e12 "TB" 1e12 "Ki" 1024.0 "KiB" 1024.0 "Mi" 1048576.0 "MiB" 1048576.0 "Gi" 1073741824.0 "GiB" 1073741824.0 "Ti" 1099511627776.0 "TiB" 1099511627776.0 -}}
{{- printf "%.0f" (ceil (mulf (float64 $num) (get $units $unit))) -}}
{{- end -}}
{{- end -}}

{{/* A CPU quantity ("500m", "2", 1.5) -> cores as a float string. */}}
{{- define "hisparse.cores" -}}
{{- $s := toString . | trim -}}
{{- if hasSuffix "m" $s -}}
{{- divf (float64 (trimSuffix "m" $s)) 1000 -}}
{{- else -}}
{{- float64 $s -}}
{{- end -}}
{{- end -}}

{{/* Bytes (an integer string) -> a memory quantity in Mi, rounded up. */}}
{{- define "hisparse.mebibytes" -}}
{{- printf "%dMi" (div (add (int64 .) 1048575) 1048576) -}}
{{- end -}}

{{/* on/off from a value of on/off/true/false. */}}
{{- define "hisparse.onOff" -}}
{{- if kindIs "bool" . -}}
{{- ternary "on" "off" . -}}
{{- else -}}
{{- . | toString | lower -}}
{{- end -}}
{{- end -}}

{{/* on/off for --offload. */}}
{{- define "hisparse.offload" -}}
{{- include "hisparse.onOff" .Values.serve.offload -}}
{{- end -}}

{{/* ---------------------------------------------------------------- sizes derived from values */}}

{{/* /dev/shm of one pod: the group's object store plus 256 MiB for Ray's and NCCL's own files. */}}
{{- define "hisparse.shmBytes" -}}
{{- add (include "hisparse.bytes" .objectStoreMemory | int64) 268435456 -}}
{{- end -}}

{{- define "hisparse.numPrefill" -}}
{{- if kindIs "invalid" .Values.serve.numPrefill -}}
{{- div (mul (int64 .Values.prefill.replicas) (int64 .Values.prefill.actorsPerPod)) (include "hisparse.ranks" .Values.prefill | int64) -}}
{{- else -}}
{{- include "hisparse.int" .Values.serve.numPrefill -}}
{{- end -}}
{{- end -}}

{{/* Ranks of one replica of a worker group (prefill or decode values): dp x tp of its layout (absent: 1). */}}
{{- define "hisparse.ranks" -}}
{{- $l := lower (toString .layout) -}}
{{- $dp := regexFind "[0-9]+" (regexFind "dp[0-9]+" $l) | default "1" | int64 -}}
{{- $tp := regexFind "[0-9]+" (regexFind "tp[0-9]+" $l) | default "1" | int64 -}}
{{- mul $dp $tp -}}
{{- end -}}

{{- define "hisparse.numDecode" -}}
{{- if kindIs "invalid" .Values.serve.numDecode -}}
{{- div (mul (int64 .Values.decode.replicas) (int64 .Values.decode.actorsPerPod)) (include "hisparse.ranks" .Values.decode | int64) -}}
{{- else -}}
{{- include "hisparse.int" .Values.serve.numDecode -}}
{{- end -}}
{{- end -}}

{{/* Host-pool bytes of one decode actor: --host-pool-bytes, or hisparse's default 8 x device budget; 0 with offload off. */}}
{{- define "hisparse.hostPoolBytes" -}}
{{- if eq (include "hisparse.offload" .) "off" -}}
0
{{- else if kindIs "invalid" .Values.serve.hostPoolBytes -}}
{{- mul (include "hisparse.bytes" .Values.serve.deviceBudget | int64) 8 -}}
{{- else -}}
{{- include "hisparse.bytes" .Values.serve.hostPoolBytes -}}
{{- end -}}
{{- end -}}

{{/*
Memory of one decode pod beyond decode.memory: per actor the host pool, the pages kept for follow-up turns
(--retain-bytes, which holds their page copies besides host-pool blocks) and, when the actor has no GPU (the
"device" pool is then host memory), the device budget; plus /dev/shm.
*/}}
{{- define "hisparse.decodeExtraBytes" -}}
{{- $perActor := include "hisparse.hostPoolBytes" . | int64 -}}
{{- if ne (include "hisparse.offload" .) "off" -}}
{{- $perActor = add $perActor (include "hisparse.bytes" .Values.serve.retainBytes | int64) -}}
{{- end -}}
{{- if eq (float64 .Values.decode.actorGpus) 0.0 -}}
{{- $perActor = add $perActor (include "hisparse.bytes" .Values.serve.deviceBudget | int64) -}}
{{- end -}}
{{- add (mul $perActor (int64 .Values.decode.actorsPerPod)) (include "hisparse.shmBytes" .Values.decode | int64) -}}
{{- end -}}

{{/* Memory of one prefill pod beyond prefill.memory: /dev/shm, plus per actor a prefix-cache host budget set
here (hisparse's own default is a share of the pod's memory, so it needs none). */}}
{{- define "hisparse.prefillExtraBytes" -}}
{{- $extra := include "hisparse.shmBytes" .Values.prefill | int64 -}}
{{- if not (kindIs "invalid" .Values.serve.prefixCacheHostBytes) -}}
{{- $extra = add $extra (mul (include "hisparse.bytes" .Values.serve.prefixCacheHostBytes | int64) (int64 .Values.prefill.actorsPerPod)) -}}
{{- end -}}
{{- $extra -}}
{{- end -}}

{{/* ---------------------------------------------------------------- hisparse serve flags */}}

{{/*
The `hisparse serve` flags common to both modes, as a JSON list (use with fromJsonArray).
Byte sizes go out as integer bytes, which every spelling of `hisparse serve` accepts.
*/}}
{{- define "hisparse.serveFlags" -}}
{{- $s := .Values.serve -}}
{{- $a := list "--model" (toString .Values.model.path) -}}
{{- with .Values.model.servedModelName -}}
{{- $a = concat $a (list "--served-model-name" (toString .)) -}}
{{- end -}}
{{- $a = concat $a (list "--placement" "resources") -}}
{{- $a = concat $a (list "--num-prefill" (include "hisparse.numPrefill" .) "--num-decode" (include "hisparse.numDecode" .)) -}}
{{- $a = concat $a (list "--prefill-num-cpus" (include "hisparse.str" .Values.prefill.actorCpus) "--prefill-num-gpus" (include "hisparse.str" .Values.prefill.actorGpus)) -}}
{{- $a = concat $a (list "--decode-num-cpus" (include "hisparse.str" .Values.decode.actorCpus) "--decode-num-gpus" (include "hisparse.str" .Values.decode.actorGpus)) -}}
{{- $a = concat $a (list "--prefill-layout" (toString .Values.prefill.layout) "--decode-layout" (toString .Values.decode.layout)) -}}
{{- $a = concat $a (list "--transport" (toString $s.transport)) -}}
{{- $a = concat $a (list "--max-batch-tokens" (include "hisparse.int" $s.maxBatchTokens)) -}}
{{- if not (kindIs "invalid" $s.prefixCache) -}}
{{- $a = concat $a (list "--prefix-cache" (include "hisparse.onOff" $s.prefixCache)) -}}
{{- end -}}
{{- if not (kindIs "invalid" $s.prefixCacheHostBytes) -}}
{{- $a = concat $a (list "--prefix-cache-host-bytes" (include "hisparse.bytes" $s.prefixCacheHostBytes)) -}}
{{- end -}}
{{- $a = concat $a (list "--max-concurrent-requests" (include "hisparse.int" $s.maxConcurrentRequests)) -}}
{{- $a = concat $a (list "--max-restarts" (include "hisparse.int" $s.maxRestarts)) -}}
{{- $a = concat $a (list "--max-sequences-per-request" (include "hisparse.int" $s.maxSequencesPerRequest)) -}}
{{- $a = concat $a (list "--max-body-bytes" (include "hisparse.bytes" $s.maxBodyBytes)) -}}
{{- $a = concat $a (list "--stream-interval" (include "hisparse.int" $s.streamInterval)) -}}
{{- $a = concat $a (list "--queue-timeout-s" (include "hisparse.str" $s.queueTimeoutSeconds)) -}}
{{- $a = concat $a (list "--max-queued-requests" (include "hisparse.int" $s.maxQueuedRequests)) -}}
{{- $a = concat $a (list "--prefill-timeout-s" (include "hisparse.str" $s.prefillTimeoutSeconds)) -}}
{{- $a = concat $a (list "--handoff-timeout-s" (include "hisparse.str" $s.handoffTimeoutSeconds)) -}}
{{- $a = concat $a (list "--token-timeout-s" (include "hisparse.str" $s.tokenTimeoutSeconds)) -}}
{{- $a = concat $a (list "--max-request-retries" (include "hisparse.int" $s.maxRequestRetries)) -}}
{{- $a = concat $a (list "--subscriber-timeout-s" (include "hisparse.str" $s.subscriberTimeoutSeconds)) -}}
{{- $a = concat $a (list "--step-hang-s" (include "hisparse.str" $s.stepHangSeconds)) -}}
{{- $a = concat $a (list "--offload" (include "hisparse.offload" .)) -}}
{{- if not (kindIs "invalid" $s.hotBufferSlots) -}}
{{- $a = concat $a (list "--hot-buffer-slots" (include "hisparse.int" $s.hotBufferSlots)) -}}
{{- end -}}
{{- $a = concat $a (list "--reserved-slots" (include "hisparse.int" $s.reservedSlots)) -}}
{{- $a = concat $a (list "--speculative-tokens" (include "hisparse.int" $s.speculativeTokens)) -}}
{{- $a = concat $a (list "--reserve" (toString $s.reserve)) -}}
{{- $a = concat $a (list "--output-estimate-tokens" (include "hisparse.int" $s.outputEstimateTokens)) -}}
{{- $a = concat $a (list "--resident" (include "hisparse.onOff" $s.resident)) -}}
{{- $a = concat $a (list "--retain-bytes" (include "hisparse.bytes" $s.retainBytes)) -}}
{{- $a = concat $a (list "--share-prefixes" (include "hisparse.int" $s.sharePrefixes)) -}}
{{- $a = concat $a (list "--device-budget" (include "hisparse.bytes" $s.deviceBudget)) -}}
{{- if not (kindIs "invalid" $s.hostPoolBytes) -}}
{{- $a = concat $a (list "--host-pool-bytes" (include "hisparse.bytes" $s.hostPoolBytes)) -}}
{{- end -}}
{{- if not (kindIs "invalid" $s.blockTokens) -}}
{{- $a = concat $a (list "--block-tokens" (include "hisparse.int" $s.blockTokens)) -}}
{{- end -}}
{{- $a = concat $a (list "--max-running" (include "hisparse.int" $s.maxRunning)) -}}
{{- $a = concat $a (list "--dtype" (toString $s.dtype)) -}}
{{- range $s.extraArgs -}}
{{- $a = append $a (include "hisparse.str" .) -}}
{{- end -}}
{{- toJson $a -}}
{{- end -}}

{{/* ---------------------------------------------------------------- gateway: CPU and API key */}}

{{/* The gateway container's CPU request and limit: gateway.cpu per gateway process x apiWorkers. */}}
{{- define "hisparse.gatewayCpu" -}}
{{- $gw := .Values.gateway -}}
{{- /* Whole millicores per process first, so 0.1 x 1000 x 3 cannot round up to 301m. */ -}}
{{- $milli := mul (round (mulf (float64 (include "hisparse.cores" $gw.cpu)) 1000.0) 0 | int64) (int64 $gw.apiWorkers) -}}
{{- if eq (mod $milli 1000) 0 -}}
{{- div $milli 1000 -}}
{{- else -}}
{{- printf "%dm" $milli -}}
{{- end -}}
{{- end -}}

{{/* Name of the Secret holding the API key: gateway.apiKey.existingSecret, or the one the chart creates. */}}
{{- define "hisparse.apiKeySecretName" -}}
{{- .Values.gateway.apiKey.existingSecret | default (printf "%s-api-key" (include "hisparse.fullname" .)) -}}
{{- end -}}

{{/*
The HISPARSE_API_KEY environment variable as a YAML list (empty with the key off), read from the
Secret by the kubelet: the key never appears in a manifest, an argument or an annotation.
optional: false, so a missing Secret or key keeps the container from starting (fails closed).
*/}}
{{- define "hisparse.apiKeyEnvName" -}}HISPARSE_API_KEY{{- end -}}

{{- define "hisparse.apiKeyEnv" -}}
{{- if .Values.gateway.apiKey.enabled -}}
- name: {{ include "hisparse.apiKeyEnvName" . }}
  valueFrom:
    secretKeyRef:
      name: {{ include "hisparse.apiKeySecretName" . }}
      key: {{ .Values.gateway.apiKey.secretKey | quote }}
      optional: false
{{- end }}
{{- end -}}

{{/* ---------------------------------------------------------------- checks the schema cannot express */}}

{{- define "hisparse.validate" -}}
{{- range $role := list "prefill" "decode" -}}
{{- $g := index $.Values $role -}}
{{- if or (lt (int64 $g.replicas) (int64 $g.minReplicas)) (gt (int64 $g.replicas) (int64 $g.maxReplicas)) -}}
{{- fail (printf "%s.replicas (%s) must lie between %s.minReplicas (%s) and %s.maxReplicas (%s)" $role (include "hisparse.int" $g.replicas) $role (include "hisparse.int" $g.minReplicas) $role (include "hisparse.int" $g.maxReplicas)) -}}
{{- end -}}
{{- $needCpu := mulf (float64 $g.actorsPerPod) (float64 $g.actorCpus) -}}
{{- if gt $needCpu (float64 (include "hisparse.cores" $g.cpu)) -}}
{{- fail (printf "%s: %s actors per pod x %v CPUs each do not fit in %s.cpu=%v" $role (include "hisparse.int" $g.actorsPerPod) $g.actorCpus $role $g.cpu) -}}
{{- end -}}
{{- $needGpu := mulf (float64 $g.actorsPerPod) (float64 $g.actorGpus) -}}
{{- if gt $needGpu (float64 $g.gpus) -}}
{{- fail (printf "%s: %s actors per pod x %v GPUs each do not fit in %s.gpus=%v" $role (include "hisparse.int" $g.actorsPerPod) $g.actorGpus $role (include "hisparse.int" $g.gpus)) -}}
{{- end -}}
{{- end -}}
{{- range $role := list "prefill" "decode" -}}
{{- $g := index $.Values $role -}}
{{- $ranks := include "hisparse.ranks" $g | int64 -}}
{{- if ne (mod (int64 $g.actorsPerPod) $ranks) 0 -}}
{{- fail (printf "%s.layout=%s has %d ranks, which share one pod: %s.actorsPerPod (%s) must be a multiple of %d" $role (toString $g.layout) $ranks $role (include "hisparse.int" $g.actorsPerPod) $ranks) -}}
{{- end -}}
{{- $max := div (mul (int64 $g.maxReplicas) (int64 $g.actorsPerPod)) $ranks -}}
{{- $num := ternary (include "hisparse.numPrefill" $) (include "hisparse.numDecode" $) (eq $role "prefill") | int64 -}}
{{- if gt $num $max -}}
{{- fail (printf "serve.num%s=%d %s replicas never fit: the %s group holds at most maxReplicas x actorsPerPod / ranks = %d" (title $role) $num $role $role $max) -}}
{{- end -}}
{{- end -}}
{{- if and (ne .Values.serve.transport "object_store") (or (eq (float64 .Values.prefill.actorGpus) 0.0) (eq (float64 .Values.decode.actorGpus) 0.0)) -}}
{{- fail (printf "serve.transport=%s moves tensors GPU to GPU: give prefill.actorGpus and decode.actorGpus at least one GPU, or use object_store" .Values.serve.transport) -}}
{{- end -}}
{{- $tp := regexFind "[0-9]+" (regexFind "tp[0-9]+" (lower (toString .Values.prefill.layout))) | default "1" | int64 -}}
{{- if and (gt $tp 1) (not (kindIs "invalid" .Values.serve.prefixCache)) (eq (include "hisparse.onOff" .Values.serve.prefixCache) "on") -}}
{{- fail (printf "serve.prefixCache=on: prefill.layout=%s has attention-TP groups, which run without the prefix cache; leave serve.prefixCache null (off there) or use a dpN[+epN] layout" (toString .Values.prefill.layout)) -}}
{{- end -}}
{{- /* The API key settings themselves are checked by values.schema.json (so `helm lint` fails too). */ -}}
{{- $envs := dict "env" .Values.env "head.env" .Values.head.env "prefill.env" .Values.prefill.env "decode.env" .Values.decode.env "gateway.env" .Values.gateway.env -}}
{{- range $where, $list := $envs -}}
{{- range $list -}}
{{- if eq (toString .name) (include "hisparse.apiKeyEnvName" $) -}}
{{- fail (printf "%s sets %s: the chart sets it from a Secret; use gateway.apiKey instead" $where (include "hisparse.apiKeyEnvName" $)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range .Values.serve.extraArgs -}}
{{- /* argparse also takes the unambiguous abbreviations --api-k and --api-ke. */ -}}
{{- if regexMatch "^--api-k(ey?)?(=|$)" (toString .) -}}
{{- fail "serve.extraArgs has --api-key, which would put the key in the pod spec and the process list; use gateway.apiKey (a Secret) instead" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* ---------------------------------------------------------------- pod pieces */}}

{{/* Container securityContext; IPC_LOCK added when .ipcLock. Call with (dict "root" $ "ipcLock" bool). */}}
{{- define "hisparse.containerSecurityContext" -}}
{{- $sc := deepCopy (.root.Values.securityContext | default dict) -}}
{{- if .ipcLock -}}
{{- $caps := deepCopy (get $sc "capabilities" | default dict) -}}
{{- $add := get $caps "add" | default list -}}
{{- $_ := set $caps "add" (append $add "IPC_LOCK" | uniq) -}}
{{- $_ := set $sc "capabilities" $caps -}}
{{- end -}}
{{- toYaml $sc -}}
{{- end -}}

{{/*
Volumes of a hisparse pod: /dev/shm as a memory-backed emptyDir and, where the model is read, the
model claim. Call with (dict "root" $ "shmBytes" "<int>" "model" bool).
*/}}
{{- define "hisparse.volumes" -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ include "hisparse.mebibytes" .shmBytes }}
{{- if and .model .root.Values.model.pvc.claimName }}
- name: model
  persistentVolumeClaim:
    claimName: {{ .root.Values.model.pvc.claimName }}
    readOnly: true
{{- end }}
{{- end -}}

{{/* Call with (dict "root" $ "model" bool). */}}
{{- define "hisparse.volumeMounts" -}}
- name: dshm
  mountPath: /dev/shm
{{- if and .model .root.Values.model.pvc.claimName }}
- name: model
  mountPath: {{ .root.Values.model.pvc.mountPath }}
  readOnly: true
  {{- with .root.Values.model.pvc.subPath }}
  subPath: {{ . }}
  {{- end }}
{{- end }}
{{- end -}}

{{- define "hisparse.scrapeAnnotations" -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: {{ .path | quote }}
{{- end -}}

{{/*
Pod template of a Ray group. Call with
(dict "root" $ "role" "head|prefill|decode" "g" <group values> "memoryExtra" "<int bytes>").
*/}}
{{- define "hisparse.rayPodTemplate" -}}
{{- $root := .root -}}
{{- $g := .g -}}
{{- $shm := include "hisparse.shmBytes" $g -}}
{{- $memory := add (include "hisparse.bytes" $g.memory | int64) (.memoryExtra | int64) -}}
{{- /* The head reads the model only in rayservice mode, where Serve replicas may run there. */ -}}
{{- $model := or (ne .role "head") (eq $root.Values.mode "rayservice") -}}
{{- $gpus := 0 -}}
{{- if hasKey $g "gpus" -}}{{- $gpus = int64 $g.gpus -}}{{- end -}}
metadata:
  labels:
    {{- include "hisparse.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ .role }}
    {{- with $g.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- if or $root.Values.metrics.scrapeAnnotations $g.podAnnotations }}
  annotations:
    {{- if $root.Values.metrics.scrapeAnnotations }}
    {{- include "hisparse.scrapeAnnotations" (dict "port" 8080 "path" "/metrics") | nindent 4 }}
    {{- end }}
    {{- with $g.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- end }}
spec:
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $root.Values.podSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $g.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  containers:
    - name: {{ ternary "ray-head" "ray-worker" (eq .role "head") }}
      image: {{ include "hisparse.image" $root }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      {{- $env := concat ($root.Values.env | default list) ($g.env | default list) }}
      {{- /* rayservice: the Serve application (build task and replica) may run in any Ray pod. */ -}}
      {{- $keyEnv := ternary (include "hisparse.apiKeyEnv" $root) "" (eq $root.Values.mode "rayservice") }}
      {{- if or $env $keyEnv }}
      env:
        {{- with $env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
        {{- with $keyEnv }}
        {{- . | nindent 8 }}
        {{- end }}
      {{- end }}
      ports:
        {{- if eq .role "head" }}
        - name: gcs-server
          containerPort: 6379
        - name: dashboard
          containerPort: 8265
        - name: client
          containerPort: 10001
        {{- if eq $root.Values.mode "rayservice" }}
        - name: serve
          containerPort: {{ $root.Values.gateway.port }}
        {{- end }}
        {{- end }}
        - name: metrics
          containerPort: 8080
      resources:
        requests:
          cpu: {{ $g.cpu | quote }}
          memory: {{ include "hisparse.mebibytes" $memory }}
          {{- if gt $gpus 0 }}
          {{ $root.Values.gpuResourceName }}: {{ $gpus }}
          {{- end }}
        limits:
          cpu: {{ $g.cpu | quote }}
          memory: {{ include "hisparse.mebibytes" $memory }}
          {{- if gt $gpus 0 }}
          {{ $root.Values.gpuResourceName }}: {{ $gpus }}
          {{- end }}
      securityContext:
        {{- include "hisparse.containerSecurityContext" (dict "root" $root "ipcLock" (and (eq .role "decode") $g.ipcLock)) | nindent 8 }}
      volumeMounts:
        {{- include "hisparse.volumeMounts" (dict "root" $root "model" $model) | nindent 8 }}
  volumes:
    {{- include "hisparse.volumes" (dict "root" $root "shmBytes" $shm "model" $model) | nindent 4 }}
  {{- with $g.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $g.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $g.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}

{{/* A scalar as a plain string: integral numbers without exponent (4e+06 -> 4000000). */}}
{{- define "hisparse.str" -}}
{{- if and (kindIs "float64" .) (eq (float64 .) (floor .)) -}}
{{- printf "%.0f" . -}}
{{- else -}}
{{- toString . -}}
{{- end -}}
{{- end -}}

{{/* rayStartParams as YAML; the CRD wants every value a string. */}}
{{- define "hisparse.rayStartParams" -}}
{{- $out := dict -}}
{{- range $k, $v := . -}}
{{- $_ := set $out $k (include "hisparse.str" $v) -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/*
A worker group's rayStartParams. The role resource is written as single-quoted JSON,
'{"hisparse_decode":1}': KubeRay pastes each parameter into a bash command line as
--resources=<value>, so the shell strips the single quotes and `ray start` receives plain JSON;
KubeRay's own resource merging trims the surrounding quotes before parsing the JSON, and the Ray
autoscaler drops the first and last character before parsing it. The value in KubeRay's older
docs, "{\"x\": 1}", passes the shell and the autoscaler but not KubeRay's JSON parsing.
*/}}
{{- define "hisparse.workerRayStartParams" -}}
{{- $role := .role -}}
{{- $g := .g -}}
{{- $res := deepCopy ($g.extraResources | default dict) -}}
{{- $_ := set $res (printf "hisparse_%s" $role) (int64 $g.actorsPerPod) -}}
{{- $forced := dict "resources" (printf "'%s'" (toJson $res)) -}}
{{- $defaults := dict "num-gpus" (include "hisparse.int" $g.gpus) "object-store-memory" (include "hisparse.bytes" $g.objectStoreMemory) "metrics-export-port" "8080" -}}
{{- include "hisparse.rayStartParams" (merge $forced (deepCopy ($g.rayStartParams | default dict)) $defaults) -}}
{{- end -}}

{{- define "hisparse.headRayStartParams" -}}
{{- $h := .Values.head -}}
{{- $defaults := dict "dashboard-host" "0.0.0.0" "object-store-memory" (include "hisparse.bytes" $h.objectStoreMemory) "metrics-export-port" "8080" "num-gpus" "0" -}}
{{- if not (kindIs "invalid" $h.numCpus) -}}
{{- $_ := set $defaults "num-cpus" (include "hisparse.str" $h.numCpus) -}}
{{- else if eq .Values.mode "raycluster" -}}
{{- $_ := set $defaults "num-cpus" "0" -}}
{{- end -}}
{{- include "hisparse.rayStartParams" (merge (deepCopy ($h.rayStartParams | default dict)) $defaults) -}}
{{- end -}}

{{/* The RayCluster spec, shared by the RayCluster and the RayService's rayClusterConfig. */}}
{{- define "hisparse.rayClusterSpec" -}}
{{- $root := . -}}
rayVersion: {{ .Values.rayVersion | quote }}
{{- if and (eq .Values.mode "raycluster") .Values.rayClusterUpgradeStrategy }}
upgradeStrategy:
  type: {{ .Values.rayClusterUpgradeStrategy }}
{{- end }}
{{- if .Values.autoscaling.enabled }}
enableInTreeAutoscaling: true
autoscalerOptions:
  upscalingMode: {{ .Values.autoscaling.upscalingMode }}
  idleTimeoutSeconds: {{ include "hisparse.int" .Values.autoscaling.idleTimeoutSeconds }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  {{- with .Values.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
headGroupSpec:
  serviceType: {{ .Values.head.serviceType }}
  rayStartParams:
    {{- include "hisparse.headRayStartParams" . | nindent 4 }}
  template:
    {{- include "hisparse.rayPodTemplate" (dict "root" $root "role" "head" "g" .Values.head "memoryExtra" (include "hisparse.shmBytes" .Values.head)) | nindent 4 }}
workerGroupSpecs:
  - groupName: prefill
    replicas: {{ include "hisparse.int" .Values.prefill.replicas }}
    minReplicas: {{ include "hisparse.int" .Values.prefill.minReplicas }}
    maxReplicas: {{ include "hisparse.int" .Values.prefill.maxReplicas }}
    rayStartParams:
      {{- include "hisparse.workerRayStartParams" (dict "role" "prefill" "g" .Values.prefill) | nindent 6 }}
    template:
      {{- include "hisparse.rayPodTemplate" (dict "root" $root "role" "prefill" "g" .Values.prefill "memoryExtra" (include "hisparse.prefillExtraBytes" .)) | nindent 6 }}
  - groupName: decode
    replicas: {{ include "hisparse.int" .Values.decode.replicas }}
    minReplicas: {{ include "hisparse.int" .Values.decode.minReplicas }}
    maxReplicas: {{ include "hisparse.int" .Values.decode.maxReplicas }}
    rayStartParams:
      {{- include "hisparse.workerRayStartParams" (dict "role" "decode" "g" .Values.decode) | nindent 6 }}
    template:
      {{- include "hisparse.rayPodTemplate" (dict "root" $root "role" "decode" "g" .Values.decode "memoryExtra" (include "hisparse.decodeExtraBytes" .)) | nindent 6 }}
{{- end -}}
