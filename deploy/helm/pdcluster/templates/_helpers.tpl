{{/* Names and labels. */}}
{{- define "pdcluster.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pdcluster.fullname" -}}
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

{{- define "pdcluster.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdcluster.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "pdcluster.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "pdcluster.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Pod labels: KubeRay owns app.kubernetes.io/name on Ray pods (it sets "kuberay"), so ours stay off them. */}}
{{- define "pdcluster.podLabels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: pdcluster
{{- with .Values.podLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "pdcluster.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "pdcluster.authSecretName" -}}
{{- .Values.auth.existingSecret | default (printf "%s-auth" (include "pdcluster.fullname" .)) }}
{{- end }}

{{/* Workers of one group the launcher will place: one per pod on CPU (one slot each; a tensor-parallel worker's
     ranks share the pod's cores), one per tp GPUs on GPU pods. Called with (dict "group" G "tp" N). */}}
{{- define "pdcluster.numWorkers" -}}
{{- if gt (int .group.gpusPerWorker) 0 }}{{ div (mul .group.replicas .group.gpusPerWorker) .tp }}{{ else }}{{ .group.replicas }}{{ end }}
{{- end }}

{{/* Ranks each worker of a group splits the model across: the group's tensorParallelSize, else
     serve.tensorParallelSize. Called with (dict "root" $ "name" "prefill"|"decode"). */}}
{{- define "pdcluster.groupTensorParallelSize" -}}
{{- $g := index .root.Values .name -}}
{{- int ($g.tensorParallelSize | default .root.Values.serve.tensorParallelSize | default 1) -}}
{{- end }}

{{/* serve.tensorParallelSize and the groups' own splits, checked against the worker groups: a worker's ranks are
     processes in one pod, so a GPU pod's GPUs must split into whole workers; GPU workers split across ranks do not
     move KV yet (disagg); colocated mode has no prefill workers to split. */}}
{{- define "pdcluster.tensorParallelSize" -}}
{{- $tp := int (.Values.serve.tensorParallelSize | default 1) -}}
{{- $disagg := eq .Values.serve.mode "disagg" }}
{{- if and (not $disagg) (gt (int (.Values.prefill.tensorParallelSize | default 0)) 0) }}
{{- fail (printf "prefill.tensorParallelSize %d: serve.mode %s has no prefill workers (set decode.tensorParallelSize or serve.tensorParallelSize)" (int .Values.prefill.tensorParallelSize) .Values.serve.mode) }}
{{- end }}
{{- $groups := ternary (list "prefill" "decode") (list "decode") $disagg }}
{{- range $name := $groups }}
{{- $gtp := int (include "pdcluster.groupTensorParallelSize" (dict "root" $ "name" $name)) }}
{{- $gpus := int (index $.Values $name).gpusPerWorker }}
{{- if and (gt $gpus 0) (ne (mod $gpus $gtp) 0) }}
{{- fail (printf "%s tensor parallel size %d: %s.gpusPerWorker %d does not split into whole workers (a worker's ranks run in one pod)" $name $gtp $name $gpus) }}
{{- end }}
{{- if and (gt $gtp 1) $disagg (gt $gpus 0) }}
{{- fail (printf "%s tensor parallel size %d with GPU pods needs serve.mode colocated: KV transfer between split caches runs on CPUs only" $name $gtp) }}
{{- end }}
{{- end }}
{{- $tp }}
{{- end }}

{{/* "gpu" when the worker pods have GPUs: the launcher then places workers on GPUs, not slots. */}}
{{- define "pdcluster.device" -}}
{{- if gt (int .Values.decode.gpusPerWorker) 0 }}gpu{{ else }}cpu{{ end }}
{{- end }}

{{/* `pdcluster serve` argv after "pdcluster serve", shell-quoted for the head's bash script (the schema
     forbids single quotes in these values). The API key and cluster secret come from the environment. */}}
{{- define "pdcluster.serveArgs" -}}
{{- $s := .Values.serve -}}
{{- $tp := int (include "pdcluster.tensorParallelSize" .) -}}
{{- $args := list "--address" "auto" "--host" "0.0.0.0" "--port" (toString $s.port) "--mode" $s.mode -}}
{{- $args = concat $args (list "--transport" $s.transport "--router-policy" $s.routerPolicy) -}}
{{- $decodeTp := int (include "pdcluster.groupTensorParallelSize" (dict "root" . "name" "decode")) -}}
{{- if eq $s.mode "disagg" }}
{{- $prefillTp := int (include "pdcluster.groupTensorParallelSize" (dict "root" . "name" "prefill")) -}}
{{- $args = concat $args (list "--num-prefill" (include "pdcluster.numWorkers" (dict "group" .Values.prefill "tp" $prefillTp))) -}}
{{- if ne $prefillTp $tp }}
{{- $args = concat $args (list "--prefill-tensor-parallel-size" (toString $prefillTp)) -}}
{{- end }}
{{- end }}
{{- $args = concat $args (list "--num-decode" (include "pdcluster.numWorkers" (dict "group" .Values.decode "tp" $decodeTp))) -}}
{{- if ne $decodeTp $tp }}
{{- $args = concat $args (list "--decode-tensor-parallel-size" (toString $decodeTp)) -}}
{{- end }}
{{- if gt $tp 1 }}
{{- $args = concat $args (list "--tensor-parallel-size" (toString $tp)) -}}
{{- end }}
{{- $args = concat $args (list "--model" $s.model "--dtype" $s.dtype "--spec" $s.spec "--num-spec-tokens" (toString $s.numSpecTokens)) -}}
{{- if .Values.kvSharedTier.existingClaim }}
{{- $args = concat $args (list "--kv-offload-shared-dir" "/var/lib/pdcluster/kv-shared" "--kv-offload-shared-gib" (toString .Values.kvSharedTier.gib)) -}}
{{- end }}
{{- if .Values.tls.secretName }}
{{- $args = concat $args (list "--ssl-certfile" "/etc/pdcluster-tls/tls.crt" "--ssl-keyfile" "/etc/pdcluster-tls/tls.key") -}}
{{- if .Values.tls.refresh }}
{{- $args = append $args "--enable-ssl-refresh" -}}
{{- end }}
{{- end }}
{{- $args = concat $args $s.extraArgs -}}
{{- range $i, $a := $args }}{{ if $i }} {{ end }}{{ $a | squote }}{{ end }}
{{- end }}

{{/* The worker pods' preStop command: drain every worker on this pod's Ray node (its address is the pod
     IP) through the API Service, waiting up to drain.timeoutS. The admin key comes from the environment. */}}
{{- define "pdcluster.drainCommand" -}}
pdcluster drain --url {{ include "pdcluster.scheme" . }}://{{ include "pdcluster.fullname" . }}-api.{{ .Release.Namespace }}.svc:{{ .Values.service.port }} --node-ip "$PDCLUSTER_POD_IP" --timeout-s {{ .Values.drain.timeoutS }}
{{- if .Values.tls.secretName }} --cacert /etc/pdcluster-tls/ca.crt{{ end }}
{{- end }}

{{/* The API's scheme: https where tls.secretName names the certificate's Secret. */}}
{{- define "pdcluster.scheme" -}}
{{- if .Values.tls.secretName }}https{{ else }}http{{ end }}
{{- end }}

{{/* A worker group: KubeRay's generated `ray start` (KUBERAY_GEN_RAY_START_CMD), since the cluster
     overrides container commands for the head's sake. */}}
{{- define "pdcluster.workerGroup" -}}
{{- $root := .root -}}
{{- $g := .group -}}
- groupName: {{ .name }}
  replicas: {{ $g.replicas }}
  minReplicas: {{ $g.replicas }}
  maxReplicas: {{ $g.replicas }}
  rayStartParams:
    # One slot per pod: the launcher places one {{ .name }} worker per slot on CPU clusters. Single-quoted
    # JSON is the form KubeRay itself writes and parses.
    resources: {{ printf "'{\"%s_slot\": 1}'" .name | quote }}
    {{- if gt (int $g.gpusPerWorker) 0 }}
    num-gpus: {{ $g.gpusPerWorker | quote }}
    {{- end }}
  template:
    metadata:
      labels:
        {{- include "pdcluster.podLabels" $root | nindent 8 }}
        app.kubernetes.io/component: {{ .name }}
      {{- with $root.Values.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      {{- if $root.Values.drain.enabled }}
      # Covers the preStop drain (drain.timeoutS) and the stop after it.
      terminationGracePeriodSeconds: {{ add $root.Values.drain.timeoutS 30 }}
      {{- end }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: ray-worker
          image: {{ include "pdcluster.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: ["/bin/bash", "-c", "--"]
          # The inner bash keeps the quoted JSON of --resources intact.
          args: ['ulimit -n 65536; exec /bin/bash -c "$KUBERAY_GEN_RAY_START_CMD"']
          {{- if $root.Values.drain.enabled }}
          # Pod termination drains this pod's worker first (cluster/api/admin.py): no new requests, the
          # ones it has finish, a prefill worker's KV transfers are acknowledged; then it is stopped and
          # Kubernetes sends SIGTERM. A failed hook (server gone, no admin key) only shows as an event.
          lifecycle:
            preStop:
              exec:
                command: ["/bin/bash", "-c", {{ include "pdcluster.drainCommand" $root | quote }}]
          {{- end }}
          resources:
            requests:
              {{- toYaml $g.resources.requests | nindent 14 }}
              {{- if gt (int $g.gpusPerWorker) 0 }}
              {{ $root.Values.gpuResourceName }}: {{ $g.gpusPerWorker }}
              {{- end }}
            limits:
              {{- toYaml $g.resources.limits | nindent 14 }}
              {{- if gt (int $g.gpusPerWorker) 0 }}
              {{ $root.Values.gpuResourceName }}: {{ $g.gpusPerWorker }}
              {{- end }}
          env:
            # What the preStop hook needs: this pod's IP (its Ray node's address) and the admin key.
            - name: PDCLUSTER_POD_IP
              valueFrom:
                fieldRef:
                  fieldPath: status.podIP
            - name: PDCLUSTER_ADMIN_KEY
              valueFrom:
                secretKeyRef:
                  name: {{ include "pdcluster.authSecretName" $root }}
                  key: admin-key
                  optional: true
            {{- with $root.Values.env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          {{- $caMount := and $root.Values.tls.secretName $root.Values.drain.enabled }}
          {{- $kvShared := $root.Values.kvSharedTier.existingClaim }}
          {{- if or $caMount $kvShared $root.Values.volumeMounts }}
          volumeMounts:
            {{- if $kvShared }}
            # The shared KV tier (--kv-offload-shared-dir): the same folder in every worker pod.
            - name: pdcluster-kv-shared
              mountPath: /var/lib/pdcluster/kv-shared
            {{- end }}
            {{- if $caMount }}
            # The CA the preStop drain checks the API's certificate against (the Secret's key stays on the head).
            - name: pdcluster-tls-ca
              mountPath: /etc/pdcluster-tls
              readOnly: true
            {{- end }}
            {{- with $root.Values.volumeMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          {{- end }}
      {{- if or $caMount $kvShared $root.Values.volumes }}
      volumes:
        {{- if $kvShared }}
        - name: pdcluster-kv-shared
          persistentVolumeClaim:
            claimName: {{ $kvShared }}
        {{- end }}
        {{- if $caMount }}
        - name: pdcluster-tls-ca
          secret:
            secretName: {{ $root.Values.tls.secretName }}
            items:
              - {key: {{ $root.Values.tls.caKey }}, path: ca.crt}
        {{- end }}
        {{- with $root.Values.volumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- end }}
      {{- with $g.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $g.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $g.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end }}
