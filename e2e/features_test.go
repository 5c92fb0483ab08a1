package e2e

import (
	"context"
	"net/http"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/e2e/cluster"
	"github.com/qemu-kubelet/qemu-kubelet/oci/ocitest"
	"github.com/qemu-kubelet/qemu-kubelet/provider"
	"github.com/qemu-kubelet/qemu-kubelet/provider/nodestatus"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/provider/vmtest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/utils/ptr"
)

// TestNodeFeatures: a node started with features.uefi and
// features.portForward off shows them (annotation, ConfigOK, kubectl
// describe node), refuses port-forward, and holds a UEFI pod Pending with
// FeatureDisabled; a bad file sent with SIGHUP is rejected (ConfigInvalid,
// nothing changes); a good one enabling uefi starts the held pod while the
// running VM keeps its QEMU process, with a changed restart-only field
// reported (RestartRequired); a change of the file alone (no signal) is
// picked up too. The node's QEMU runs without transparent huge pages
// (TCG, vmMemory.transparentHugePages Auto).
func TestNodeFeatures(t *testing.T) {
	ctx := context.Background()
	prebuild(t, kubeletPkg) // under way while the control plane starts
	c := cluster.StartT(t, cluster.Options{})
	reg := ocitest.StartRegistry(t, ocitest.RegistryOptions{})
	refs := vmtest.PushTestImages(t, reg.Addr)
	bin := buildQemuKubelet(t)
	const offLine = "features: {uefi: false, portForward: false}\n"
	a := newNodeAgent(t, c, bin, "qk-features", "tcg", offLine)
	vmtest.ReapQEMU(t, a.dir)
	t.Cleanup(func() { deleteAllPods(t, c, "default", a.dir) })
	a.start()
	waitNode(t, c, a.name, 90*time.Second, "Ready=True", readyIs(corev1.ConditionTrue))

	n := waitNode(t, c, a.name, 30*time.Second, "features shown", func(n *corev1.Node) bool {
		return n.Annotations[nodestatus.AnnotationFeatures] != ""
	})
	assert.Equal(t, "attach=true,jumpstarterExporter=true,portForward=false,uefi=false,consoleLogSize=8Mi", n.Annotations[nodestatus.AnnotationFeatures])
	cond := condition(n, nodestatus.ConditionConfigOK)
	require.NotNil(t, cond)
	assert.Equal(t, corev1.ConditionTrue, cond.Status)
	assert.Equal(t, nodestatus.ReasonConfigApplied, cond.Reason)
	out, err := c.Kubectl(ctx, "describe", "node", a.name)
	require.NoError(t, err)
	assert.Contains(t, out, "qemu-kubelet.io/features: attach=true,jumpstarterExporter=true,portForward=false,uefi=false")
	assert.Regexp(t, `ConfigOK\s+True\s+.*ConfigApplied`, out)

	// A VM that runs through every reload.
	run := e2eCreate(t, c, vmPodSpec("feat-running", a.name, refs[vmtest.VariantACPI], corev1.RestartPolicyAlways, nil))
	run = waitPod(t, c, "default", run.Name, 120*time.Second, "Running", podRunning)
	runPids := vmtest.QEMUPids(a.vmDir(string(run.UID)))
	require.Len(t, runPids, 1)
	// A TCG node's QEMU runs without transparent huge pages
	// (vmMemory.transparentHugePages: Auto): the flag the agent set on
	// itself at start.
	status, err := os.ReadFile("/proc/" + strconv.Itoa(runPids[0]) + "/status")
	require.NoError(t, err)
	assert.Regexp(t, `(?m)^THP_enabled:\s+0$`, string(status), "QEMU %d of a TCG node", runPids[0])
	runStarted := run.Status.ContainerStatuses[0].State.Running.StartedAt

	// port-forward is refused by the node, naming the setting.
	tlsCfg := a.kubeletTLS(t, c.AdminKubeconfig())
	code, body := a.kubeletGet(t, "/portForward/default/"+run.Name, tlsCfg, "")
	assert.Equal(t, http.StatusForbidden, code, body)
	assert.Contains(t, body, "port-forward is disabled on node "+a.name+" (features.portForward: false")

	// A UEFI pod is held: Pending, FeatureDisabled with the reason, an
	// event, no QEMU.
	// Its VM starts late in the test and is deleted at its end, still in
	// its firmware's slow boot under TCG (the power button unheard): a
	// short grace period, as the test checks no graceful stop.
	uefi := vmPodSpec("feat-uefi", a.name, refs[vmtest.VariantACPI], corev1.RestartPolicyAlways,
		map[string]string{podspec.AnnotationFirmware: "uefi"})
	uefi.Spec.TerminationGracePeriodSeconds = ptr.To(shortGrace)
	held := e2eCreate(t, c, uefi)
	isHeld := func(p *corev1.Pod) bool {
		return p.Status.Phase == corev1.PodPending && len(p.Status.ContainerStatuses) == 1 &&
			p.Status.ContainerStatuses[0].State.Waiting != nil && p.Status.ContainerStatuses[0].State.Waiting.Reason == provider.ReasonFeatureDisabled
	}
	held = waitPod(t, c, "default", held.Name, 60*time.Second, "held (FeatureDisabled)", isHeld)
	assert.Contains(t, held.Status.ContainerStatuses[0].State.Waiting.Message, "features.uefi: false")
	waitEvent(t, c, held.Name, provider.ReasonFeatureDisabled, "pod needs uefi")
	out, err = c.Kubectl(ctx, "get", "pod", held.Name)
	require.NoError(t, err)
	assert.Contains(t, out, provider.ReasonFeatureDisabled, "kubectl get pod shows the reason")
	assert.Empty(t, vmtest.QEMUPids(a.vmDir(string(held.UID))))

	// A bad file: rejected, the node says so, nothing else changes.
	rewrite := func(from, to string) {
		t.Helper()
		b, err := os.ReadFile(a.configPath)
		require.NoError(t, err)
		require.Contains(t, string(b), from)
		require.NoError(t, os.WriteFile(a.configPath, []byte(strings.Replace(string(b), from, to, 1)), 0o600))
	}
	rewrite(offLine, "features: {uefi: true, snapshotStart: true}\n")
	a.signal(t, syscall.SIGHUP)
	n = waitNode(t, c, a.name, 30*time.Second, "ConfigOK=False/ConfigInvalid", func(n *corev1.Node) bool {
		c := condition(n, nodestatus.ConditionConfigOK)
		return c != nil && c.Reason == nodestatus.ReasonConfigInvalid
	})
	assert.Contains(t, condition(n, nodestatus.ConditionConfigOK).Message, `unknown field "features.snapshotStart"`)
	assert.Contains(t, n.Annotations[nodestatus.AnnotationFeatures], "uefi=false", "the previous features stay")
	waitEvent(t, c, a.name, nodestatus.ReasonConfigInvalid, "the previous configuration stays in force")
	time.Sleep(3 * time.Second)
	waitPod(t, c, "default", held.Name, time.Second, "still held", isHeld)

	// uefi on (portForward back to its default) and maxVMs changed: the
	// features apply, the held pod starts, maxVMs waits for a restart.
	rewrite("features: {uefi: true, snapshotStart: true}\n", "features: {uefi: true}\n")
	rewrite("maxVMs: 7\n", "maxVMs: 6\n")
	a.signal(t, syscall.SIGHUP)
	n = waitNode(t, c, a.name, 30*time.Second, "ConfigOK=False/RestartRequired", func(n *corev1.Node) bool {
		c := condition(n, nodestatus.ConditionConfigOK)
		return c != nil && c.Reason == nodestatus.ReasonRestartRequired
	})
	assert.Contains(t, condition(n, nodestatus.ConditionConfigOK).Message, "after a restart: maxVMs")
	assert.Equal(t, "attach=true,jumpstarterExporter=true,portForward=true,uefi=true,consoleLogSize=8Mi", n.Annotations[nodestatus.AnnotationFeatures])
	assert.Equal(t, "7", n.Status.Capacity.Pods().String(), "maxVMs not half-applied")
	held = waitPod(t, c, "default", held.Name, 120*time.Second, "Running after the reload", podRunning)
	require.Len(t, vmtest.QEMUPids(a.vmDir(string(held.UID))), 1)
	waitEvent(t, c, held.Name, "FeatureEnabled", "uefi enabled")
	code, body = a.kubeletGet(t, "/portForward/default/"+run.Name, tlsCfg, "")
	assert.NotContains(t, body, "is disabled", "port-forward served again (code %d)", code)

	// The running VM was never touched: same QEMU, same start, no restart.
	run = waitPod(t, c, "default", run.Name, 10*time.Second, "Running", podRunning)
	assert.Equal(t, runPids, vmtest.QEMUPids(a.vmDir(string(run.UID))), "same QEMU pid after the reloads")
	assert.Equal(t, int32(0), run.Status.ContainerStatuses[0].RestartCount)
	assert.True(t, runStarted.Equal(&run.Status.ContainerStatuses[0].State.Running.StartedAt))

	// Back to maxVMs 7 by editing the file only: picked up without a
	// signal (the file is checked every 10s); ConfigOK is True again.
	rewrite("maxVMs: 6\n", "maxVMs: 7\n")
	waitNode(t, c, a.name, 45*time.Second, "ConfigOK=True after a file change", func(n *corev1.Node) bool {
		c := condition(n, nodestatus.ConditionConfigOK)
		return c != nil && c.Status == corev1.ConditionTrue && c.Reason == nodestatus.ReasonConfigApplied
	})
	assert.Equal(t, runPids, vmtest.QEMUPids(a.vmDir(string(run.UID))))
	require.NoError(t, a.alive(), "SIGHUP never stops the agent")
}

func e2eCreate(t *testing.T, c *cluster.Cluster, p *corev1.Pod) *corev1.Pod {
	t.Helper()
	got, err := c.Client().CoreV1().Pods(p.Namespace).Create(context.Background(), p, metav1.CreateOptions{})
	require.NoError(t, err)
	return got
}

// waitEvent waits for an event about the object named name (pod or node)
// with reason and a message containing msg.
func waitEvent(t *testing.T, c *cluster.Cluster, name, reason, msg string) {
	t.Helper()
	var seen []string
	require.Eventually(t, func() bool {
		l, err := c.Client().CoreV1().Events("default").List(context.Background(), metav1.ListOptions{
			FieldSelector: fields.OneTermEqualSelector("involvedObject.name", name).String()})
		if err != nil {
			return false
		}
		seen = seen[:0]
		for _, e := range l.Items {
			seen = append(seen, e.Reason+": "+e.Message)
			if e.Reason == reason && strings.Contains(e.Message, msg) {
				return true
			}
		}
		return false
	}, 30*time.Second, 200*time.Millisecond, "event %s %q about %s; seen %v", reason, msg, name, seen)
}

// signal sends sig to the agent process alone (not its process group:
// its VMs must not get it).
func (a *nodeAgent) signal(t *testing.T, sig syscall.Signal) {
	t.Helper()
	a.mu.Lock()
	cmd := a.cmd
	a.mu.Unlock()
	require.NotNil(t, cmd)
	require.NoError(t, cmd.Process.Signal(sig))
}

// alive is nil while the agent process runs.
func (a *nodeAgent) alive() error {
	a.mu.Lock()
	done := a.done
	a.mu.Unlock()
	select {
	case <-done:
		a.mu.Lock()
		defer a.mu.Unlock()
		if a.err != nil {
			return a.err
		}
		return os.ErrProcessDone
	default:
		return nil
	}
}
