package provider

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"
)

// A pod that names a Secret in the annotation
// v1alpha1.JumpstarterSecretAnnotation is a Jumpstarter exporter served by
// this node agent: no sidecar, no agent in the guest. The exporter
// (package jumpstarter, run through VMsConfig.Exporters) drives the pod's
// VM through a vmTarget:
//   - power off: ACPI power button within the pod's grace period, then quit
//     (as a delete, but the pod and its state dir stay); the pod stays
//     phase Running, its container shows Waiting/PoweredOff (Ready=False)
//     with the run's end as lastState, restartCount is unchanged and the
//     restart policy does not apply;
//   - power on: boots again from a fresh overlay (of the flashed image, if
//     any), or with state policy Retain from the disk as it was (state.go);
//   - console: the serial console kubectl attach uses (many readers, one
//     writer: the same flock);
//   - TCP to a guest port: the runtime forward kubectl port-forward uses;
//   - flash: pull and verify through the node's image store (same errors as
//     a pod's pull; nothing is touched on failure), power off, boot the new
//     image from then on with a fresh disk (Retain too) (kept in status.json: VM and agent restarts keep
//     it), power on again if it was on;
//   - flash and dump of partitions from files: exporter_flash.go (the VM's
//     jumpstarter.DiskTarget).
//
// The exporter runs from the pod's first worker start (recovery included)
// to its deletion (it unregisters first), whether or not QEMU runs: a
// powered-off VM still answers power on. Its state is the pod condition
// ConditionJumpstarterExporter and events; a wrong token shows there and
// never touches the VM.

// ConditionJumpstarterExporter is the pod condition showing the exporter's
// state: True while Online or Leased; the reason is the state (Connecting,
// Registered, Online, Leased, Failed, Stopped), the message the last error.
const ConditionJumpstarterExporter corev1.PodConditionType = "qemu-kubelet.io/JumpstarterExporter"

// Pod event reasons of the exporter.
const (
	EventExporterRegistered = "ExporterRegistered"
	EventExporterOnline     = "ExporterOnline"
	EventExporterLeased     = "ExporterLeased"
	EventExporterFailed     = "ExporterFailed"
)

// ExporterRunner runs one Jumpstarter exporter until ctx ends, then
// unregisters it. It retries lost connections itself; an error return
// means it cannot run with this configuration. cmd/qemu-kubelet passes the
// jumpstarter package's; tests pass fakes.
type ExporterRunner interface {
	RunExporter(ctx context.Context, cfg jumpstarter.Config) error
}

// ExporterRunnerFunc adapts a function to ExporterRunner.
type ExporterRunnerFunc func(ctx context.Context, cfg jumpstarter.Config) error

// RunExporter calls f.
func (f ExporterRunnerFunc) RunExporter(ctx context.Context, cfg jumpstarter.Config) error {
	return f(ctx, cfg)
}

// ErrVMPoweredOff: the request needs a running VM.
var ErrVMPoweredOff = errors.New("the VM is not running (powered off, or not started yet): power it on first")

// exporterDriverNames are the exporter's own drivers; guest ports may not
// take these names.
var exporterDriverNames = map[string]bool{"power": true, "console": true, "flasher": true}

// ExporterSettings builds the exporter configuration of pod from its
// Secret: endpoint, token, namespace and name are required, ca.crt
// optional; the labels sent with Register are the pod's jumpstarter.dev/
// labels; the guest ports are the container's named TCP ports (unnamed:
// "tcp-<port>"); the hostname is the pod name. A missing or bad key is a
// ConfigError naming it (never the token's value). Pure.
func ExporterSettings(pod *corev1.Pod, secret *corev1.Secret) (jumpstarter.Config, error) {
	where := podspec.ExporterSecretWhere(pod)
	get := func(key string) (string, error) {
		v := strings.TrimSpace(string(secret.Data[key]))
		if v == "" {
			v = strings.TrimSpace(secret.StringData[key])
		}
		if v == "" {
			return "", &podspec.ConfigError{Msg: fmt.Sprintf("%s: key %q is missing or empty", where, key)}
		}
		return v, nil
	}
	var cfg jumpstarter.Config
	var err error
	if cfg.Endpoint, err = get(v1alpha1.JumpstarterSecretEndpoint); err != nil {
		return cfg, err
	}
	if err := validateEndpoint(cfg.Endpoint); err != nil {
		return cfg, &podspec.ConfigError{Msg: fmt.Sprintf("%s: key %q: %v", where, v1alpha1.JumpstarterSecretEndpoint, err)}
	}
	if cfg.Token, err = get(v1alpha1.JumpstarterSecretToken); err != nil {
		return cfg, err
	}
	if strings.ContainsAny(cfg.Token, " \t\r\n") {
		return cfg, &podspec.ConfigError{Msg: fmt.Sprintf("%s: key %q holds white space inside the token", where, v1alpha1.JumpstarterSecretToken)}
	}
	if cfg.Namespace, err = get(v1alpha1.JumpstarterSecretNamespace); err != nil {
		return cfg, err
	}
	if cfg.Name, err = get(v1alpha1.JumpstarterSecretName); err != nil {
		return cfg, err
	}
	if ca := secret.Data[v1alpha1.JumpstarterSecretCA]; len(ca) > 0 {
		if !x509.NewCertPool().AppendCertsFromPEM(ca) {
			return cfg, &podspec.ConfigError{Msg: fmt.Sprintf("%s: key %q holds no PEM certificate", where, v1alpha1.JumpstarterSecretCA)}
		}
		cfg.CABundle = append([]byte(nil), ca...)
	}
	for k, v := range pod.Labels {
		if strings.HasPrefix(k, "jumpstarter.dev/") {
			if cfg.Labels == nil {
				cfg.Labels = map[string]string{}
			}
			cfg.Labels[k] = v
		}
	}
	login, err := podspec.GuestLoginFromSecret(secret, where) // podspec/guestlogin.go
	if err != nil {
		return cfg, err
	}
	if login != nil {
		cfg.Username, cfg.Password = login.Username, login.Password
	}
	cfg.Display = pod.Annotations[podspec.AnnotationDisplay] == podspec.DisplayVNC
	cfg.Ports = exporterPorts(pod, cfg.Display)
	cfg.Hostname = pod.Name
	return cfg, nil
}

// validateEndpoint accepts host:port with a port in 1-65535.
func validateEndpoint(ep string) error {
	host, port, err := net.SplitHostPort(ep)
	if err != nil {
		return fmt.Errorf("%q is not host:port: %v", ep, err)
	}
	if host == "" {
		return fmt.Errorf("%q has no host", ep)
	}
	if strings.ContainsAny(host, "/ ") {
		return fmt.Errorf("%q: host %q is not a host name or address (no scheme or path)", ep, host)
	}
	n, err := strconv.Atoi(port)
	if err != nil || n < 1 || n > 65535 {
		return fmt.Errorf("%q: port %q is not a number in 1-65535", ep, port)
	}
	return nil
}

// exporterPorts are the guest TCP ports the exporter offers: the first
// container's TCP ports by name, sorted by port. A port named after a
// built-in driver (vnc too when the VM has a display) is named
// "tcp-<port>".
func exporterPorts(pod *corev1.Pod, display bool) []jumpstarter.Port {
	if len(pod.Spec.Containers) == 0 {
		return nil
	}
	var out []jumpstarter.Port
	seen := map[string]bool{}
	for _, cp := range pod.Spec.Containers[0].Ports {
		if cp.Protocol != "" && cp.Protocol != corev1.ProtocolTCP {
			continue
		}
		name := cp.Name
		if name == "" || exporterDriverNames[name] || (display && name == jumpstarter.DriverVNC) {
			name = fmt.Sprintf("tcp-%d", cp.ContainerPort)
		}
		if seen[name] {
			continue
		}
		seen[name] = true
		out = append(out, jumpstarter.Port{Name: name, Port: int(cp.ContainerPort)})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Port < out[j].Port })
	return out
}

// redact removes the token from a message (errors may quote what they
// were sent).
func redact(msg, token string) string {
	if token == "" {
		return msg
	}
	return strings.ReplaceAll(msg, token, "<token>")
}

// exporterConfig reads the pod's Secret and builds its exporter settings.
// A missing Secret is a ConfigError (the VM waits in
// CreateContainerConfigError, as for a volume's Secret).
func (p *VMs) exporterConfig(ctx context.Context, pod *corev1.Pod) (jumpstarter.Config, error) {
	name := podspec.ExporterSecretName(pod)
	s, err := podspec.GetSecret(ctx, podspec.ConfigSources{Secret: p.cfg.Secrets}, pod.Namespace, name)
	if apierrors.IsForbidden(err) {
		// The Node authorizer lets a node read only the Secrets a pod's spec
		// references; an annotation is not such a reference.
		return jumpstarter.Config{}, &podspec.ConfigError{Msg: fmt.Sprintf("the node agent may not read secret %q of namespace %s (the Jumpstarter exporter secret): reference it from a secret volume of the pod (it stays on the host, the guest never sees it), or grant the node get on it by RBAC; %v", name, pod.Namespace, err)}
	}
	if err != nil {
		return jumpstarter.Config{}, fmt.Errorf("jumpstarter exporter: %w", err)
	}
	if s == nil {
		return jumpstarter.Config{}, &podspec.ConfigError{Msg: fmt.Sprintf("secret %q not found (the Jumpstarter exporter secret named by annotation %s)", name, v1alpha1.JumpstarterSecretAnnotation)}
	}
	return ExporterSettings(pod, s)
}

// checkExporterConfig holds a pod's VM start until its exporter Secret
// exists and is valid (vmSpec): a pod that asked to be an exporter never
// runs as something else.
func (p *VMs) checkExporterConfig(ctx context.Context, pod *corev1.Pod) error {
	if podspec.ExporterSecretName(pod) == "" {
		return nil
	}
	_, err := p.exporterConfig(ctx, pod)
	return err
}

// exporterStatus is what the pod shows of its exporter.
type exporterStatus struct {
	state jumpstarter.State
	msg   string
	since time.Time
}

// applyExporter adds the exporter condition to a pod status. Pure.
func applyExporter(status *corev1.PodStatus, es *exporterStatus) {
	if es == nil {
		return
	}
	c := corev1.PodCondition{Type: ConditionJumpstarterExporter, Status: corev1.ConditionFalse,
		Reason: string(es.state), Message: es.msg, LastTransitionTime: metav1.NewTime(es.since.UTC())}
	if es.state == jumpstarter.StateOnline || es.state == jumpstarter.StateLeased {
		c.Status = corev1.ConditionTrue
	}
	status.Conditions = append(status.Conditions, c)
}

// exporterEvent is the event a transition to s makes ("" for none).
func exporterEvent(s jumpstarter.State) (typ, reason string) {
	switch s {
	case jumpstarter.StateRegistered:
		return corev1.EventTypeNormal, EventExporterRegistered
	case jumpstarter.StateOnline:
		return corev1.EventTypeNormal, EventExporterOnline
	case jumpstarter.StateLeased:
		return corev1.EventTypeNormal, EventExporterLeased
	case jumpstarter.StateFailed:
		return corev1.EventTypeWarning, EventExporterFailed
	}
	return "", ""
}

// setExporterState records an exporter state change on the pod (condition,
// event) and pushes the status. A repeated Failed with the same message
// makes no new event.
func (p *VMs) setExporterState(rec *podVM, s jumpstarter.State, msg string) {
	rec.mu.Lock()
	prev := rec.exp.status
	if prev != nil && prev.state == s && prev.msg == msg {
		rec.mu.Unlock()
		return
	}
	since := p.now()
	if prev != nil && prev.state == s {
		since = prev.since
	}
	rec.exp.status = &exporterStatus{state: s, msg: msg, since: since}
	pod := rec.pod.DeepCopy()
	rec.mu.Unlock()
	if typ, reason := exporterEvent(s); reason != "" {
		text := fmt.Sprintf("Jumpstarter exporter %s", strings.ToLower(string(s)))
		if msg != "" {
			text += ": " + msg
		}
		p.event(pod, typ, reason, text)
	}
	p.push(rec)
}

// startExporter starts the pod's exporter supervisor if the pod asks for
// one and it has not started yet: when the pod is first Ready (the worker's evReady) or
// found powered off by recovery (the worker). Idempotent.
func (p *VMs) startExporter(ctx context.Context, rec *podVM) {
	rec.mu.Lock()
	pod := rec.pod.DeepCopy()
	skip := rec.state.Rejection != nil || rec.state.Final || rec.del.deleting || rec.exp.started
	if podspec.ExporterSecretName(pod) != "" && !skip {
		rec.exp.started = true
	}
	rec.mu.Unlock()
	if podspec.ExporterSecretName(pod) == "" || skip {
		return
	}
	if p.cfg.Exporters == nil {
		p.setExporterState(rec, jumpstarter.StateFailed, "this node agent runs no Jumpstarter exporter")
		return
	}
	ectx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	rec.mu.Lock()
	rec.exp.stop, rec.exp.done = cancel, done
	rec.mu.Unlock()
	go func() {
		defer close(done)
		p.superviseExporter(ectx, rec)
	}()
}

// stopExporter ends the exporter supervisor (it unregisters); idempotent.
func (rec *podVM) stopExporter() {
	rec.mu.Lock()
	stop := rec.exp.stop
	rec.mu.Unlock()
	if stop != nil {
		stop()
	}
}

// waitExporter waits up to d for the exporter supervisor to end.
func (rec *podVM) waitExporter(d time.Duration) {
	rec.mu.Lock()
	done := rec.exp.done
	rec.mu.Unlock()
	if done == nil {
		return
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
	}
}

// exporterRecheck is how often a running exporter's Secret is read again:
// a changed Secret (e.g. a fixed token) restarts the exporter with it.
var exporterRecheck = podspec.ConfigRetryMax

// superviseExporter runs the pod's exporter until ctx ends: it reads the
// Secret (waiting for it, with back-off), runs the exporter, and restarts
// it when the Secret changes or the exporter gives up.
func (p *VMs) superviseExporter(ctx context.Context, rec *podVM) {
	log := klog.FromContext(ctx).WithName("jumpstarter")
	book := jumpstarter.NewLogBook() // the pod's LogStream lines, across exporter restarts
	target := &vmTarget{p: p, rec: rec}
	for attempt := 1; ; attempt++ {
		rec.mu.Lock()
		pod := rec.pod.DeepCopy()
		rec.mu.Unlock()
		cfg, err := p.exporterConfig(ctx, pod)
		if ctx.Err() != nil {
			p.setExporterState(rec, jumpstarter.StateStopped, "")
			return
		}
		if err != nil {
			log.Info("Exporter not started", "err", err.Error())
			p.setExporterState(rec, jumpstarter.StateFailed, err.Error())
			if !sleepCtx(ctx, min(p.cfg.Backoff.Delay(attempt), podspec.ConfigRetryMax)) {
				p.setExporterState(rec, jumpstarter.StateStopped, "")
				return
			}
			continue
		}
		token := cfg.Token
		cfg.Target = target
		cfg.Logs = book
		cfg.Log = log
		cfg.Observer = p.cfg.Telemetry.ExporterObserver()
		cfg.OnState = func(s jumpstarter.State, err error) {
			msg := ""
			if err != nil {
				msg = redact(err.Error(), token)
			}
			if s == jumpstarter.StateStopped {
				return // the supervisor reports its own stop
			}
			p.setExporterState(rec, s, msg)
		}
		p.setExporterState(rec, jumpstarter.StateConnecting, "")
		rctx, cancel := context.WithCancel(ctx)
		ended := make(chan error, 1)
		go func() { ended <- p.cfg.Exporters.RunExporter(rctx, cfg) }()
		log.Info("Exporter started", "endpoint", cfg.Endpoint, "exporter", cfg.Namespace+"/"+cfg.Name)
		changed := p.watchExporterSecret(rctx, pod, cfg, ended)
		cancel()
		err = <-ended
		switch {
		case ctx.Err() != nil:
			p.setExporterState(rec, jumpstarter.StateStopped, "")
			log.Info("Exporter stopped")
			return
		case changed:
			log.Info("Exporter secret changed; restarting the exporter")
			attempt = 0
			continue
		case err != nil:
			msg := redact(err.Error(), token)
			log.Info("Exporter ended", "err", msg)
			p.setExporterState(rec, jumpstarter.StateFailed, msg)
		}
		if !sleepCtx(ctx, min(p.cfg.Backoff.Delay(attempt), podspec.ConfigRetryMax)) {
			p.setExporterState(rec, jumpstarter.StateStopped, "")
			return
		}
	}
}

// watchExporterSecret waits until the exporter ends (its error is put
// back on ended), ctx ends, or the Secret changes (true).
func (p *VMs) watchExporterSecret(ctx context.Context, pod *corev1.Pod, cfg jumpstarter.Config, ended chan error) bool {
	t := time.NewTicker(exporterRecheck)
	defer t.Stop()
	for {
		select {
		case err := <-ended:
			ended <- err
			return false
		case <-ctx.Done():
			return false
		case <-t.C:
			cur, err := p.exporterConfig(ctx, pod)
			if err != nil {
				continue // keep the running exporter; a fixed Secret restarts it
			}
			if cur.Endpoint != cfg.Endpoint || cur.Token != cfg.Token || cur.Namespace != cfg.Namespace ||
				cur.Name != cfg.Name || string(cur.CABundle) != string(cfg.CABundle) || !reflect.DeepEqual(cur.Labels, cfg.Labels) {
				return true
			}
		}
	}
}
