package e2e

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/provider/vmtest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
)

// poweroffAfterBootCmdline makes the test image's init power the guest off
// (exit 0) right after its boot marker (hack/testimage/init.sh).
const poweroffAfterBootCmdline = "qk.poweroff"

// testPowerOffAlways: under restartPolicy Always a guest that boots and then
// powers itself off (exit code 0) is started again, restartCount counting
// each run, the last run reported as Terminated/Completed.
func (e *podEnv) testPowerOffAlways(t *testing.T) {
	spec := vmPodSpec("poweroff-always", e.a.name, e.refs[vmtest.VariantACPI], corev1.RestartPolicyAlways,
		map[string]string{"qemu-kubelet.io/kernel-cmdline": poweroffAfterBootCmdline})
	// The delete below comes right after the restart that made
	// restartCount 2, on a guest still booting: a short grace period stops
	// it at once instead of waiting for the guest to power itself off. This
	// test checks no graceful stop (BootsRunningAndDeletesGracefully does).
	spec.Spec.TerminationGracePeriodSeconds = ptr.To(shortGrace)
	p := e.create(t, spec)
	rec := recordPod(t, e.c, "default", p.Name)
	p = waitPod(t, e.c, "default", p.Name, 180*time.Second, "restartCount >= 2", func(p *corev1.Pod) bool {
		return len(p.Status.ContainerStatuses) == 1 && p.Status.ContainerStatuses[0].RestartCount >= 2
	})
	cs := p.Status.ContainerStatuses[0]
	last := cs.LastTerminationState.Terminated
	require.NotNil(t, last, "lastState of a restarted VM: %+v", cs)
	assert.Equal(t, int32(0), last.ExitCode)
	assert.Equal(t, "Completed", last.Reason)
	assert.NotEqual(t, corev1.PodSucceeded, p.Status.Phase, "Always never lets the pod complete")
	assert.NotEqual(t, corev1.PodFailed, p.Status.Phase)
	// The kubelet backs off between restarts of a container that keeps
	// exiting: CrashLoopBackOff is reported while waiting.
	backoff := false
	for _, tag := range rec.seen() {
		backoff = backoff || strings.HasSuffix(tag, "/CrashLoopBackOff")
	}
	assert.True(t, backoff, "CrashLoopBackOff between restarts; states seen: %v", rec.seen())
	assert.LessOrEqual(t, len(vmtest.QEMUPids(e.a.vmDir(string(p.UID)))), 1, "at most one QEMU per pod")
	// The previous run booted fully before powering itself off: its console
	// through the real kubectl.
	prev, err := e.c.Kubectl(context.Background(), "logs", "--previous", p.Name)
	require.NoError(t, err, prev)
	assert.Contains(t, prev, vmtest.BootMarker, "previous run's console:\n%s", tail(prev, 20))
	assert.Contains(t, prev, "QK-POWEROFF", "previous run's console:\n%s", tail(prev, 20))
	require.NoError(t, e.c.Client().CoreV1().Pods("default").Delete(context.Background(), p.Name, metav1.DeleteOptions{}))
	waitPodGone(t, e.c, "default", p.Name, 60*time.Second)
	waitNoDir(t, e.a.vmDir(string(p.UID)), 30*time.Second)
}

// wideRow returns the row of `kubectl get pod -o wide` output for pod name
// as column -> value.
func wideRow(t *testing.T, out, name string) map[string]string {
	t.Helper()
	lines := strings.Split(strings.TrimSpace(out), "\n")
	require.GreaterOrEqual(t, len(lines), 2, out)
	// Columns are aligned: a value starts where its heading starts.
	head := lines[0]
	cols := []string{"NAME", "READY", "STATUS", "RESTARTS", "AGE", "IP", "NODE", "NOMINATED NODE"}
	for _, l := range lines[1:] {
		if f := strings.Fields(l); len(f) == 0 || f[0] != name {
			continue
		}
		row := map[string]string{}
		for _, c := range cols {
			i := strings.Index(head, c)
			if c == "NODE" {
				i = strings.Index(head, " NODE ") + 1
			}
			if i <= 0 && c != "NAME" || i >= len(l) {
				continue
			}
			if f := strings.Fields(l[i:]); len(f) > 0 {
				row[c] = f[0]
			}
		}
		return row
	}
	t.Fatalf("no row for %s in:\n%s", name, out)
	return nil
}

// assertDescribeNodeLists checks `kubectl describe node` output: the pod is
// under "Non-terminated Pods" with its cpu/memory requests, and the
// "Allocated resources" section sums them.
func assertDescribeNodeLists(t *testing.T, out, ns, pod, cpu, mem string) {
	t.Helper()
	sec := describeSection(out, "Non-terminated Pods:")
	found := false
	for _, l := range strings.Split(sec, "\n") {
		f := strings.Fields(l)
		if len(f) >= 4 && f[0] == ns && f[1] == pod {
			found = true
			assert.Equal(t, cpu, f[2], "cpu request of %s: %q", pod, l)
			assert.Contains(t, l, mem, "memory request of %s: %q", pod, l)
		}
	}
	assert.True(t, found, "pod %s/%s not under Non-terminated Pods:\n%s", ns, pod, sec)
	alloc := describeSection(out, "Allocated resources:")
	var cpuLine, memLine string
	for _, l := range strings.Split(alloc, "\n") {
		f := strings.Fields(l)
		if len(f) >= 2 && f[0] == "cpu" {
			cpuLine = l
		}
		if len(f) >= 2 && f[0] == "memory" {
			memLine = l
		}
	}
	require.NotEmpty(t, cpuLine, "no cpu line under Allocated resources:\n%s", alloc)
	require.NotEmpty(t, memLine, "no memory line under Allocated resources:\n%s", alloc)
	assert.Equal(t, cpu, strings.Fields(cpuLine)[1], "allocated cpu requests: %q", cpuLine)
	assert.Equal(t, mem, strings.Fields(memLine)[1], "allocated memory requests: %q", memLine)
}

// describeSection returns the lines of a top-level `kubectl describe`
// section: from its heading to the next unindented line.
func describeSection(out, heading string) string {
	i := strings.Index(out, heading)
	if i < 0 {
		return ""
	}
	var b strings.Builder
	for j, l := range strings.Split(out[i:], "\n") {
		if j > 0 && l != "" && l[0] != ' ' {
			break
		}
		b.WriteString(l + "\n")
	}
	return b.String()
}
