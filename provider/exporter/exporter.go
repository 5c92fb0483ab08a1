package exporter

import (
	"context"
	"errors"
	"fmt"
	"net"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/provider/guest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"
)

// The exporter drives the pod's VM through its target (target.go):
//   - power off: ACPI power button within the pod's grace period, then quit
//     (as a delete, but the pod and its state dir stay); the pod stays
//     phase Running, its container shows Waiting/PoweredOff (Ready=False)
//     with the run's end as lastState, restartCount is unchanged and the
//     restart policy does not apply;
//   - power on: boots again from a fresh overlay (of the flashed image, if
//     any), or with state policy Retain from the disk as it was;
//   - console: the serial console kubectl attach uses (many readers, one
//     writer: the same flock);
//   - TCP to a guest port: the runtime forward kubectl port-forward uses;
//   - flash: pull and verify through the node's image store (same errors as
//     a pod's pull; nothing is touched on failure), power off, boot the new
//     image from then on with a fresh disk (Retain too) (kept in
//     status.json: VM and agent restarts keep it), power on again if it
//     was on;
//   - flash and dump of partitions from files: flash.go (the VM's
//     jumpstarter.DiskTarget).
//
// The exporter runs from the pod's first Ready (or from the pod found
// powered off) to its deletion (it unregisters first), whether or not QEMU
// runs: a powered-off VM still answers power on. Its state is the pod
// condition Condition and events; a wrong token shows there and never
// touches the VM.

// Node is what the exporters of a node's pods share (set by package
// provider from its configuration).
type Node struct {
	// Runner runs the exporters (nil: the pods show the condition Failed;
	// their VMs still run).
	Runner Runner
	// Secrets reads a Secret (nil: none can be read).
	Secrets func(ctx context.Context, namespace, name string) (*corev1.Secret, error)
	// Images is the node's image cache (nil: flash is refused).
	Images Images
	// UEFICode and UEFIVars are the node's OVMF files (empty: none).
	UEFICode, UEFIVars string
	// Backoff paces the retries of a Secret that cannot be used and of an
	// exporter that gave up.
	Backoff podstatus.Backoff
	// Observer receives the exporters' metrics (nil: none).
	Observer jumpstarter.Observer
	// Now is the clock of the condition's transition times (nil: time.Now).
	Now func() time.Time
}

func (n *Node) now() time.Time {
	if n.Now == nil {
		return time.Now()
	}
	return n.Now()
}

// Condition is the pod condition showing the exporter's
// state: True while Online or Leased; the reason is the state (Connecting,
// Registered, Online, Leased, Failed, Stopped), the message the last error.
const Condition corev1.PodConditionType = "qemu-kubelet.io/JumpstarterExporter"

// Pod event reasons of the exporter.
const (
	EventExporterRegistered = "ExporterRegistered"
	EventExporterOnline     = "ExporterOnline"
	EventExporterLeased     = "ExporterLeased"
	EventExporterFailed     = "ExporterFailed"
)

// Runner runs one Jumpstarter exporter until ctx ends, then unregisters
// it. It retries lost connections itself; an error return means it cannot
// run with this configuration. cmd/qemu-kubelet passes the jumpstarter
// package's; tests pass fakes.
type Runner interface {
	RunExporter(ctx context.Context, cfg jumpstarter.Config) error
}

// RunnerFunc adapts a function to Runner.
type RunnerFunc func(ctx context.Context, cfg jumpstarter.Config) error

// RunExporter calls f.
func (f RunnerFunc) RunExporter(ctx context.Context, cfg jumpstarter.Config) error {
	return f(ctx, cfg)
}

// ErrVMPoweredOff: the request needs a running VM.
var ErrVMPoweredOff = errors.New("the VM is not running (powered off, or not started yet): power it on first")

// exporterDriverNames are the exporter's own drivers; guest ports may not
// take these names.
var exporterDriverNames = map[string]bool{"power": true, "console": true, "flasher": true}

// Settings builds the exporter configuration of pod from its
// Secret: the controller's endpoint, the token, the Exporter's namespace
// and name and the CA from upstream's ExporterConfig (key config.yaml)
// or our keys (credentials); the labels sent with Register are the pod's jumpstarter.dev/
// labels; the guest ports are the container's named TCP ports (unnamed:
// "tcp-<port>"); the hostname is the pod name. A missing or bad key is a
// ConfigError naming it (never the token's value). Pure.
func Settings(pod *corev1.Pod, secret *corev1.Secret) (jumpstarter.Config, error) {
	where := podspec.ExporterSecretWhere(pod)
	cfg, err := credentials(secret, where) // exporterconfig.go: upstream's config.yaml or our keys
	if err != nil {
		return cfg, err
	}
	for k, v := range pod.Labels {
		if strings.HasPrefix(k, "jumpstarter.dev/") {
			if cfg.Labels == nil {
				cfg.Labels = map[string]string{}
			}
			cfg.Labels[k] = v
		}
	}
	login, err := podspec.GuestLoginFromSecret(secret, where) // provider/podspec/guestlogin.go
	if err != nil {
		return cfg, err
	}
	if login != nil {
		cfg.Username, cfg.Password = login.Username, login.Password
	}
	ls, err := podspec.LeaseSettingsOf(pod) // the set's leaseStatePolicy and hooks
	if err != nil {
		return cfg, &podspec.ConfigError{Msg: err.Error()}
	}
	cfg.Hooks = leaseHooks(ls)
	cfg.Display, err = podspec.DisplayOf(pod) // the VM's display (Plan.Display): on by default
	if err != nil {
		return cfg, &podspec.ConfigError{Msg: err.Error()}
	}
	ssh, err := podspec.SSHDriverOf(pod)
	if err != nil {
		return cfg, &podspec.ConfigError{Msg: err.Error()}
	}
	cfg.Ports = exporterPorts(pod, cfg.Display, ssh)
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
// container's TCP ports by name, and with ssh the default ssh child
// (jumpstarter.DefaultSSHPort, as upstream's QEMU driver always has one)
// unless a container port is named ssh, which wins; sorted by port, then
// name. A port named after a built-in driver (vnc too when the VM has a
// display) is named "tcp-<port>". Pure.
func exporterPorts(pod *corev1.Pod, display, ssh bool) []jumpstarter.Port {
	var out []jumpstarter.Port
	seen := map[string]bool{}
	var cports []corev1.ContainerPort
	if len(pod.Spec.Containers) > 0 {
		cports = pod.Spec.Containers[0].Ports
	}
	for _, cp := range cports {
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
	if ssh && !seen[jumpstarter.DriverSSH] {
		out = append(out, jumpstarter.Port{Name: jumpstarter.DriverSSH, Port: jumpstarter.DefaultSSHPort})
	}
	sort.SliceStable(out, func(i, j int) bool {
		if out[i].Port != out[j].Port {
			return out[i].Port < out[j].Port
		}
		return out[i].Name < out[j].Name
	})
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

// Images is what the exporter uses of the node's image cache (flash,
// disk size, dump of the root partition); *oci.Store satisfies it.
type Images interface {
	// Pull resolves ref and pulls it into the cache (with policy PullNever:
	// only what is cached, no registry).
	Pull(ctx context.Context, ref string, opts oci.PullOptions) (*oci.Image, error)
	// Acquire holds the image of digest dgst against GC until release.
	Acquire(dgst string) (release func(), err error)
}

// VM is what the exporter uses of a running VM: the console, guest ports
// and the display.
type VM interface {
	guest.VM
	// DialDisplay is a connection to the VNC server of a VM with a
	// display; an error for one without.
	DialDisplay(ctx context.Context) (net.Conn, error)
}

// Pod is one pod as its exporter sees it: package provider implements it
// over the pod's record and its worker. Methods are safe for concurrent
// use.
type Pod interface {
	// Pod is the pod as bound, with its current metadata (a copy).
	Pod() *corev1.Pod
	// Record is the pod's VM plan and its state (copies; the state's maps
	// are shared and never changed in place).
	Record() (podspec.Plan, podstatus.VMState)
	// Dir is the pod's state dir; Overlay the VM's writable disk in it.
	Dir() string
	Overlay() string
	// VM is the running VM (nil: none runs).
	VM() VM
	// Event records an event on the pod; Changed has its status pushed
	// (the exporter condition or the size changed).
	Event(typ, reason, msg string)
	Changed()
	// PowerOn, PowerOff and Flash are requests to the pod's worker, which
	// alone starts, stops and re-images the VM; each waits for the
	// worker's answer or ctx. Flash powers the VM off, installs f
	// (f.Place, f.Record) and powers it on again if it was on; f.Hold is
	// released by whoever ends up not using it.
	PowerOn(ctx context.Context) error
	PowerOff(ctx context.Context) error
	Flash(ctx context.Context, f *Flash) error
	// SetSize is a request to the pod's worker to record a new VM size:
	// under the node's admission lock it calls check with the pod, the
	// node's capacity and the other active pods (their memory claims), and
	// if check accepts, change on the pod's size; the size is written to
	// the state dir before SetSize returns (a failed write keeps the old
	// size and is the error). It waits for the worker's answer or ctx.
	SetSize(ctx context.Context, check func(pod *corev1.Pod, node podspec.NodeCapacity, others []*corev1.Pod) error, change func(*podstatus.VMSize)) error
}

// readConfig reads the pod's Secret and builds its exporter settings.
// A missing Secret is a ConfigError (the VM waits in
// CreateContainerConfigError, as for a volume's Secret).
func readConfig(ctx context.Context, secrets func(ctx context.Context, namespace, name string) (*corev1.Secret, error), pod *corev1.Pod) (jumpstarter.Config, error) {
	name := podspec.ExporterSecretName(pod)
	s, err := podspec.GetSecret(ctx, podspec.ConfigSources{Secret: secrets}, pod.Namespace, name)
	if apierrors.IsForbidden(err) {
		// The Node authorizer lets a node read only the Secrets a pod's spec
		// references; an annotation is not such a reference.
		return jumpstarter.Config{}, &podspec.ConfigError{Msg: fmt.Sprintf("the node agent may not read secret %q of namespace %s (the Jumpstarter exporter secret): reference it from a secret volume of the pod (it stays on the host, the guest never sees it), or grant the node get on it by RBAC; %v", name, pod.Namespace, err)}
	}
	if err != nil {
		return jumpstarter.Config{}, fmt.Errorf("jumpstarter exporter: %w", err)
	}
	if s == nil {
		return jumpstarter.Config{}, podspec.ExporterSecretNotFound(pod)
	}
	return Settings(pod, s)
}

// CheckConfig holds a pod's VM start until its exporter Secret exists and
// is valid: a pod that asked to be an exporter never runs as something
// else. nil for a pod that is no exporter.
func CheckConfig(ctx context.Context, secrets func(ctx context.Context, namespace, name string) (*corev1.Secret, error), pod *corev1.Pod) error {
	if podspec.ExporterSecretName(pod) == "" {
		return nil
	}
	_, err := readConfig(ctx, secrets, pod)
	return err
}

// status is what the pod shows of its exporter.
type status struct {
	state jumpstarter.State
	msg   string
	since time.Time
}

// applyCondition adds the exporter condition to a pod status. Pure.
func applyCondition(st *corev1.PodStatus, es *status) {
	if es == nil {
		return
	}
	c := corev1.PodCondition{Type: Condition, Status: corev1.ConditionFalse,
		Reason: string(es.state), Message: es.msg, LastTransitionTime: metav1.NewTime(es.since.UTC())}
	if es.state == jumpstarter.StateOnline || es.state == jumpstarter.StateLeased {
		c.Status = corev1.ConditionTrue
	}
	st.Conditions = append(st.Conditions, c)
}

// stateEvent is the event a transition to s makes ("" for none).
func stateEvent(s jumpstarter.State) (typ, reason string) {
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

// Supervisor is one pod's exporter: it lives with the pod once started.
// Its mutex guards status only and is a leaf: the pod's status snapshot
// takes it (Apply) under the pod's lock.
type Supervisor struct {
	node   *Node
	pod    Pod
	target *Target

	mu     sync.Mutex
	status *status
	// stop ends the supervisor; done is closed once it has ended (nil: it
	// never ran).
	stop context.CancelFunc
	done chan struct{}
}

// New is the exporter of pod, not running yet (Start).
func New(node *Node, pod Pod) *Supervisor {
	return &Supervisor{node: node, pod: pod, target: NewTarget(node, pod)}
}

// Start runs the supervisor until ctx ends or Stop. With no Runner it
// only shows the condition Failed.
func (s *Supervisor) Start(ctx context.Context) {
	if s.node.Runner == nil {
		s.setState(jumpstarter.StateFailed, "this node agent runs no Jumpstarter exporter")
		return
	}
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	s.mu.Lock()
	s.stop, s.done = cancel, done
	s.mu.Unlock()
	go func() {
		defer close(done)
		s.supervise(ctx)
	}()
}

// Stop ends the supervisor (the exporter unregisters); idempotent.
func (s *Supervisor) Stop() {
	s.mu.Lock()
	stop := s.stop
	s.mu.Unlock()
	if stop != nil {
		stop()
	}
}

// Wait waits up to d for the supervisor to end.
func (s *Supervisor) Wait(d time.Duration) {
	s.mu.Lock()
	done := s.done
	s.mu.Unlock()
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

// Apply adds the exporter condition to the pod's status (nothing for a
// nil s or an exporter that showed no state yet).
func (s *Supervisor) Apply(st *corev1.PodStatus) {
	if s == nil {
		return
	}
	s.mu.Lock()
	es := s.status
	s.mu.Unlock()
	applyCondition(st, es)
}

// setState records an exporter state change (condition, event) and has the
// pod's status pushed. A repeated Failed with the same message makes no
// new event.
func (s *Supervisor) setState(st jumpstarter.State, msg string) {
	s.mu.Lock()
	prev := s.status
	if prev != nil && prev.state == st && prev.msg == msg {
		s.mu.Unlock()
		return
	}
	since := s.node.now()
	if prev != nil && prev.state == st {
		since = prev.since
	}
	s.status = &status{state: st, msg: msg, since: since}
	s.mu.Unlock()
	if typ, reason := stateEvent(st); reason != "" {
		text := fmt.Sprintf("Jumpstarter exporter %s", strings.ToLower(string(st)))
		if msg != "" {
			text += ": " + msg
		}
		s.pod.Event(typ, reason, text)
	}
	s.pod.Changed()
}

// SecretRecheck is how often a running exporter's Secret is read again:
// a changed Secret (e.g. a fixed token) restarts the exporter with it.
var SecretRecheck = podspec.ConfigRetryMax

// supervise runs the pod's exporter until ctx ends: it reads the Secret
// (waiting for it, with back-off), runs the exporter, and restarts it when
// the Secret changes or the exporter gives up.
func (s *Supervisor) supervise(ctx context.Context) {
	log := klog.FromContext(ctx).WithName("jumpstarter")
	book := jumpstarter.NewLogBook() // the pod's LogStream lines, across exporter restarts
	node := s.node
	for attempt := 1; ; attempt++ {
		pod := s.pod.Pod()
		cfg, err := readConfig(ctx, node.Secrets, pod)
		if ctx.Err() != nil {
			s.setState(jumpstarter.StateStopped, "")
			return
		}
		if err != nil {
			log.Info("Exporter not started", "err", err.Error())
			s.setState(jumpstarter.StateFailed, err.Error())
			if !sleep(ctx, min(node.Backoff.Delay(attempt), podspec.ConfigRetryMax)) {
				s.setState(jumpstarter.StateStopped, "")
				return
			}
			continue
		}
		token := cfg.Token
		cfg.Target = s.target
		cfg.Logs = book
		cfg.Log = log
		cfg.Observer = node.Observer
		cfg.OnState = func(st jumpstarter.State, err error) {
			msg := ""
			if err != nil {
				msg = redact(err.Error(), token)
			}
			if st == jumpstarter.StateStopped {
				return // the supervisor reports its own stop
			}
			if st == jumpstarter.StateOnline || st == jumpstarter.StateLeased {
				msg = leaseStateNote(cfg.Hooks)
			}
			s.setState(st, msg)
		}
		s.setState(jumpstarter.StateConnecting, "")
		rctx, cancel := context.WithCancel(ctx)
		ended := make(chan error, 1)
		go func() { ended <- node.Runner.RunExporter(rctx, cfg) }()
		log.Info("Exporter started", "endpoint", cfg.Endpoint, "exporter", cfg.Namespace+"/"+cfg.Name)
		changed := s.watchSecret(rctx, pod, cfg, ended)
		cancel()
		err = <-ended
		switch {
		case ctx.Err() != nil:
			s.setState(jumpstarter.StateStopped, "")
			log.Info("Exporter stopped")
			return
		case changed:
			log.Info("Exporter secret changed; restarting the exporter")
			attempt = 0
			continue
		case errors.Is(err, jumpstarter.ErrExitOnLeaseEnd):
			// As upstream's exporter with exitOnLeaseEnd: offline for good;
			// the pod's set replaces the pod (exporterconfig.go).
			log.Info("Exporter ended at lease end (exitOnLeaseEnd)")
			s.setState(jumpstarter.StateStopped, exitedOnLeaseEnd)
			<-ctx.Done()
			s.setState(jumpstarter.StateStopped, "")
			return
		case errors.Is(err, jumpstarter.ErrHookExit):
			// As upstream's exit code 1: not restarted; the pod's
			// recreation (or the node agent's restart) brings it back.
			msg := redact(err.Error(), token) + "; the exporter stays offline until the pod is recreated"
			log.Info("Exporter ended by a lease hook", "err", msg)
			s.setState(jumpstarter.StateFailed, msg)
			<-ctx.Done()
			s.setState(jumpstarter.StateStopped, "")
			return
		case err != nil:
			msg := redact(err.Error(), token)
			log.Info("Exporter ended", "err", msg)
			s.setState(jumpstarter.StateFailed, msg)
		}
		if !sleep(ctx, min(node.Backoff.Delay(attempt), podspec.ConfigRetryMax)) {
			s.setState(jumpstarter.StateStopped, "")
			return
		}
	}
}

// watchSecret waits until the exporter ends (its error is put back on
// ended), ctx ends, or the Secret changes (true).
func (s *Supervisor) watchSecret(ctx context.Context, pod *corev1.Pod, cfg jumpstarter.Config, ended chan error) bool {
	t := time.NewTicker(SecretRecheck)
	defer t.Stop()
	for {
		select {
		case err := <-ended:
			ended <- err
			return false
		case <-ctx.Done():
			return false
		case <-t.C:
			cur, err := readConfig(ctx, s.node.Secrets, pod)
			if err != nil {
				continue // keep the running exporter; a fixed Secret restarts it
			}
			if cur.Endpoint != cfg.Endpoint || cur.Token != cfg.Token || cur.Namespace != cfg.Namespace ||
				cur.Name != cfg.Name || string(cur.CABundle) != string(cfg.CABundle) || !reflect.DeepEqual(cur.Labels, cfg.Labels) ||
				cur.ExitOnLeaseEnd != cfg.ExitOnLeaseEnd {
				return true
			}
		}
	}
}

// sleep waits d or until ctx ends (false).
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
