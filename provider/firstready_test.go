package provider

import (
	"context"
	"github.com/qemu-kubelet/qemu-kubelet/provider/internal/podtest"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
)

// The run's first Ready is the pod worker's event (evReady, podworker.go),
// on fake VMs (fakehv_test.go) in milliseconds: it starts the pod's
// Jumpstarter exporter. A readiness probe holds the exporter until the
// probe passes; a pod without one gets it as soon as its VM runs; a
// restarted VM finds it running (one exporter per pod); a VM re-adopted by
// the next agent gets it again from that agent's worker.

// exporterFakeVMs is a fake-VM harness whose pods in namespace lab may
// name the exporter Secret js (podtest.ExporterSecretKV), run by runner.
func exporterFakeVMs(t *testing.T, stateDir string, hv *fakeHypervisor, runner *fakeRunner) *fakeVMHarness {
	secrets := &secretStore{m: map[string]*corev1.Secret{}}
	secrets.put(podtest.ExporterSecret(podtest.ExporterSecretKV...))
	return newFakeVMHarness(t, stateDir, hv, 10*time.Millisecond, func(c *VMsConfig) {
		c.Secrets = secrets.get
		c.Exporters = runner
	})
}

func exporterFakePod(uid string, readiness bool) *corev1.Pod {
	pod := podFor(uid, "reg.example/os:1", corev1.RestartPolicyAlways, map[string]string{v1alpha1.JumpstarterSecretAnnotation: "js"})
	pod.Namespace = "lab"
	if readiness {
		pod.Spec.Containers[0].ReadinessProbe = &corev1.Probe{PeriodSeconds: 1,
			ProbeHandler: corev1.ProbeHandler{Exec: &corev1.ExecAction{Command: []string{"/bin/true"}}}}
	}
	return pod
}

func ready(p *corev1.Pod) bool { return running(p) && podstatus.Ready(p) }

// noExporterRun checks that no exporter run starts within d.
func noExporterRun(t *testing.T, runner *fakeRunner, d time.Duration, why string) {
	t.Helper()
	select {
	case r := <-runner.ch:
		t.Errorf("%s: an exporter run started (%s/%s)", why, r.cfg.Namespace, r.cfg.Name)
	case <-time.After(d):
	}
}

func TestFakeVMExporterAtFirstReady(t *testing.T) {
	ctx := context.Background()
	hv := newFakeHypervisor()
	runner := newFakeRunner()
	f := exporterFakeVMs(t, t.TempDir(), hv, runner)

	pod := exporterFakePod("u-ready", true)
	require.NoError(t, f.vms.CreatePod(ctx, pod))
	vm := nextVM(t, hv)
	f.wait(pod.UID, 5*time.Second, "Running", running)
	noExporterRun(t, runner, 700*time.Millisecond, "the readiness probe fails")
	assert.False(t, podstatus.Ready(f.wait(pod.UID, time.Second, "Running", running)), "not Ready while the probe fails")

	hv.guestUp.Store(true)
	r := runner.next(t, 5*time.Second)
	assert.Equal(t, "board-0", r.cfg.Name)
	f.wait(pod.UID, 5*time.Second, "Ready", ready)

	// A restart: the new run's first Ready finds the exporter running.
	require.True(t, vm.crash())
	nextVM(t, hv)
	f.wait(pod.UID, 5*time.Second, "Ready after the restart", func(p *corev1.Pod) bool {
		return ready(p) && p.Status.ContainerStatuses[0].RestartCount == 1
	})
	noExporterRun(t, runner, 300*time.Millisecond, "the exporter lives with the pod")
	assert.NoError(t, r.ctx.Err(), "the first run still runs")

	// No readiness probe: Ready, and the exporter, as soon as the VM runs.
	plain := exporterFakePod("u-plain", false)
	require.NoError(t, f.vms.CreatePod(ctx, plain))
	nextVM(t, hv)
	r2 := runner.next(t, 5*time.Second)
	f.wait(plain.UID, 5*time.Second, "Ready", ready)
	assert.NoError(t, r2.ctx.Err())

	f.deleteFakePod(t, pod)
	f.deleteFakePod(t, plain)
	for _, run := range []*fakeRun{r, r2} {
		select {
		case <-run.ctx.Done():
		case <-time.After(5 * time.Second):
			t.Fatal("a deleted pod's exporter still runs")
		}
	}
	f.assertNoHolds(t)
}

// An agent restart: the next agent re-adopts the running VM and its
// worker, finding the pod Ready, starts the exporter again.
func TestFakeVMExporterAfterRecovery(t *testing.T) {
	ctx := context.Background()
	stateDir := t.TempDir()
	hv := newFakeHypervisor()
	runner1 := newFakeRunner()
	f1 := exporterFakeVMs(t, stateDir, hv, runner1)
	pod := exporterFakePod("u-adopt", false)
	require.NoError(t, f1.vms.CreatePod(ctx, pod))
	nextVM(t, hv)
	r1 := runner1.next(t, 5*time.Second)
	rec := f1.rec(pod.UID)
	f1.cancel()
	waitWorkerDone(t, rec)
	select {
	case <-r1.ctx.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("the stopped agent's exporter still runs")
	}

	runner2 := newFakeRunner()
	f2 := exporterFakeVMs(t, stateDir, hv, runner2)
	res, err := f2.vms.Recover(ctx)
	require.NoError(t, err)
	assert.Equal(t, 1, res.Running, "the VM is re-adopted")
	r2 := runner2.next(t, 5*time.Second)
	assert.Equal(t, "board-0", r2.cfg.Name)
	starts, adopts := hv.counts()
	assert.Equal(t, 1, starts, "adopted, not started again")
	assert.Equal(t, 1, adopts)
	f2.deleteFakePod(t, pod)
}
