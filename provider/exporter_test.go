package provider

import (
	"context"
	"errors"
	"fmt"
	"github.com/qemu-kubelet/qemu-kubelet/provider/exporter"
	"github.com/qemu-kubelet/qemu-kubelet/provider/internal/podtest"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/provider/telemetry"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/tools/record"
)

func TestRegistrationResult(t *testing.T) {
	assert.Equal(t, "success", telemetry.RegistrationResult(nil))
	assert.Equal(t, "token_rejected", telemetry.RegistrationResult(status.Error(codes.Unauthenticated, "bad token")))
	// The real controller reports a bad token as code Unknown.
	assert.Equal(t, "token_rejected", telemetry.RegistrationResult(fmt.Errorf("register: %w", status.Error(codes.Unknown, "failed to authenticate token"))))
	assert.Equal(t, "permission_denied", telemetry.RegistrationResult(status.Error(codes.PermissionDenied, "x")))
	assert.Equal(t, "no_exporter", telemetry.RegistrationResult(status.Error(codes.Unknown, `exporter lab/x: exporters.jumpstarter.dev "x" not found`)))
	assert.Equal(t, "temporary", telemetry.RegistrationResult(fmt.Errorf("register: %w", status.Error(codes.Unavailable, "x"))))
	assert.Equal(t, "temporary", telemetry.RegistrationResult(errors.New("boom")))
	assert.Equal(t, "canceled", telemetry.RegistrationResult(context.Canceled))
}

// fakeRunner is an exporter.Runner that records each run and lets the test
// drive its state.
type fakeRunner struct {
	mu   sync.Mutex
	runs []*fakeRun
	ch   chan *fakeRun
}

type fakeRun struct {
	cfg   jumpstarter.Config
	ctx   context.Context
	ended chan struct{}
}

func newFakeRunner() *fakeRunner { return &fakeRunner{ch: make(chan *fakeRun, 16)} }

func (f *fakeRunner) RunExporter(ctx context.Context, cfg jumpstarter.Config) error {
	r := &fakeRun{cfg: cfg, ctx: ctx, ended: make(chan struct{})}
	f.mu.Lock()
	f.runs = append(f.runs, r)
	f.mu.Unlock()
	f.ch <- r
	<-ctx.Done()
	close(r.ended)
	return nil
}

func (f *fakeRunner) next(t *testing.T, d time.Duration) *fakeRun {
	t.Helper()
	select {
	case r := <-f.ch:
		return r
	case <-time.After(d):
		t.Fatalf("no exporter run within %s", d)
		return nil
	}
}

// secretStore is the node's view of Secrets, editable by the test.
type secretStore struct {
	mu sync.Mutex
	m  map[string]*corev1.Secret
}

func (s *secretStore) get(_ context.Context, ns, name string) (*corev1.Secret, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if x, ok := s.m[ns+"/"+name]; ok {
		return x.DeepCopy(), nil
	}
	return nil, apierrors.NewNotFound(schema.GroupResource{Resource: "secrets"}, name)
}

func (s *secretStore) put(x *corev1.Secret) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.m[x.Namespace+"/"+x.Name] = x
}

func exporterCond(p *corev1.Pod) *corev1.PodCondition {
	for i := range p.Status.Conditions {
		if p.Status.Conditions[i].Type == exporter.Condition {
			return &p.Status.Conditions[i]
		}
	}
	return nil
}

func condReason(reason string) func(*corev1.Pod) bool {
	return func(p *corev1.Pod) bool {
		c := exporterCond(p)
		return c != nil && c.Reason == reason
	}
}

// drainEvents returns the events buffered in rec (without waiting).
func drainEvents(rec *record.FakeRecorder) []string {
	var out []string
	for {
		select {
		case e := <-rec.Events:
			out = append(out, e)
		default:
			return out
		}
	}
}

// TestExporterLifecycleFake drives the exporter side of a pod with a fake
// runner, no QEMU (the image registry is unreachable, so the VM never
// starts and the test starts the supervisor itself): the Secret is waited for, state changes become the condition
// and events (never the token), a changed Secret restarts the exporter, a
// delete stops it.
func TestExporterLifecycleFake(t *testing.T) {
	old := exporter.SecretRecheck
	exporter.SecretRecheck = 100 * time.Millisecond
	t.Cleanup(func() { exporter.SecretRecheck = old })
	root := t.TempDir()
	store, err := oci.Open(filepath.Join(root, "images"), oci.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { store.Close() })
	secrets := &secretStore{m: map[string]*corev1.Secret{}}
	runner := newFakeRunner()
	events := record.NewFakeRecorder(100)
	h := newHarnessWith(t, filepath.Join(root, "state"), store, filepath.Join(root, "images"), func(c *VMsConfig) {
		c.Secrets = secrets.get
		c.Exporters = runner
		c.Recorder = events
	})
	ctx := context.Background()
	pod := podFor("u-js-fake", "127.0.0.1:1/qemu-kubelet/none:1", corev1.RestartPolicyAlways, map[string]string{v1alpha1.JumpstarterSecretAnnotation: "js"})
	pod.Namespace = "lab"
	pod.Labels = map[string]string{"jumpstarter.dev/board": "vm"}
	pod.Spec.Containers[0].Ports = []corev1.ContainerPort{{Name: "http", ContainerPort: 8080}}
	require.NoError(t, h.vms.CreatePod(ctx, pod))
	// The worker starts the exporter once the VM first runs, which never
	// happens here: start the supervisor as the worker would.
	run := h.vms.runOf(pod.UID)
	require.NotNil(t, run)
	run.startExporter(h.vms.base)

	// No Secret yet: Failed, naming it; no run.
	p := h.wait(pod.UID, 10*time.Second, "exporter Failed (no secret)", condReason("Failed"))
	assert.Contains(t, exporterCond(p).Message, `secret "js" not found`)
	assert.Empty(t, runner.runs)

	secrets.put(podtest.ExporterSecret(podtest.ExporterSecretKV...))
	r := runner.next(t, 10*time.Second)
	assert.Equal(t, "grpc.js.example:443", r.cfg.Endpoint)
	assert.Equal(t, "board-0", r.cfg.Name)
	assert.Equal(t, "vm-u-js-fake", r.cfg.Hostname)
	assert.Equal(t, map[string]string{"jumpstarter.dev/board": "vm"}, r.cfg.Labels)
	assert.Equal(t, []jumpstarter.Port{{Name: "ssh", Port: 22}, {Name: "http", Port: 8080}}, r.cfg.Ports, "the pod's port and the default ssh child")
	require.NotNil(t, r.cfg.Target)
	assert.False(t, r.cfg.Target.Powered(), "no VM runs (the image cannot be pulled)")
	h.wait(pod.UID, 5*time.Second, "Connecting", condReason("Connecting"))

	r.cfg.OnState(jumpstarter.StateRegistered, nil)
	r.cfg.OnState(jumpstarter.StateOnline, nil)
	p = h.wait(pod.UID, 5*time.Second, "Online", condReason("Online"))
	assert.Equal(t, corev1.ConditionTrue, exporterCond(p).Status)
	r.cfg.OnState(jumpstarter.StateLeased, nil)
	h.wait(pod.UID, 5*time.Second, "Leased", condReason("Leased"))
	r.cfg.OnState(jumpstarter.StateFailed, status.Error(codes.Unauthenticated, "token s3cr3t-token is not valid"))
	p = h.wait(pod.UID, 5*time.Second, "Failed", condReason("Failed"))
	assert.Equal(t, corev1.ConditionFalse, exporterCond(p).Status)
	assert.Contains(t, exporterCond(p).Message, "Unauthenticated")
	assert.NotContains(t, exporterCond(p).Message, "s3cr3t-token", "the token never shows")
	r.cfg.OnState(jumpstarter.StateFailed, status.Error(codes.Unauthenticated, "token s3cr3t-token is not valid"))

	evs := strings.Join(drainEvents(events), "\n")
	for _, want := range []string{"Normal ExporterRegistered", "Normal ExporterOnline", "Normal ExporterLeased", "Warning ExporterFailed"} {
		assert.Contains(t, evs, want)
	}
	assert.Equal(t, 1, strings.Count(evs, "ExporterFailed Jumpstarter exporter failed: rpc error"), "a repeated failure makes one event:\n%s", evs)
	assert.NotContains(t, evs, "s3cr3t-token")

	// A fixed token in the Secret restarts the exporter with it.
	fixed := podtest.ExporterSecret(podtest.ExporterSecretKV...)
	fixed.Namespace = "lab"
	fixed.Data["token"] = []byte("new-token")
	secrets.put(fixed)
	r2 := runner.next(t, 5*time.Second)
	assert.Equal(t, "new-token", r2.cfg.Token)
	select {
	case <-r.ended:
	case <-time.After(5 * time.Second):
		t.Fatal("the old exporter was not stopped")
	}

	// Delete: the exporter stops (unregisters) and the pod goes.
	require.NoError(t, h.vms.DeletePod(ctx, deleting(pod)))
	select {
	case <-r2.ended:
	case <-time.After(10 * time.Second):
		t.Fatal("the exporter was not stopped on delete")
	}
	h.wait(pod.UID, 10*time.Second, "terminated", func(p *corev1.Pod) bool { return terminated(p) != nil })
	select {
	case r := <-runner.ch:
		t.Fatalf("an exporter started after delete: %+v", r.cfg.Name)
	case <-time.After(300 * time.Millisecond):
	}
}

func TestTranslateExporterAnnotation(t *testing.T) {
	pod := podFor("u", "r/os:1", corev1.RestartPolicyAlways, map[string]string{v1alpha1.JumpstarterSecretAnnotation: "board-0-js"})
	_, rej := podspec.Translate(pod, qemu.ArchX86_64)
	assert.Nil(t, rej, "a known annotation")
	pod.Annotations[v1alpha1.JumpstarterSecretAnnotation] = "Not_A_Name"
	_, rej = podspec.Translate(pod, qemu.ArchX86_64)
	require.NotNil(t, rej)
	assert.Contains(t, rej.Message, "metadata.annotations["+v1alpha1.JumpstarterSecretAnnotation+"]: secret name \"Not_A_Name\"")
}

// podCond is the pod's condition of type t (nil: none).
func podCond(p *corev1.Pod, t corev1.PodConditionType) *corev1.PodCondition {
	for i := range p.Status.Conditions {
		if p.Status.Conditions[i].Type == t {
			return &p.Status.Conditions[i]
		}
	}
	return nil
}
