package e2e

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/provider/vmtest"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// armNodeConfig is the node-config fragment that makes TestPods' agent
// also register <node>-arm64 (arm64 guests under TCG) with its own node
// identity (NodeRestriction: a node writes only its own objects) and port.
func armNodeConfig(t *testing.T, e *podEnv, node string) string {
	t.Helper()
	kc, err := e.c.NodeKubeconfig(node + "-arm64")
	require.NoError(t, err)
	return fmt.Sprintf("guestArchitectures:\n- {arch: arm64, maxVMs: 2, port: %d, kubeconfig: %s}\n", testutil.FreePort(t), kc)
}

// testArm64Guest: a multi-arch OS image (an OCI index of the amd64 and
// arm64 test images) runs as an arm64 VM on the arm64 node, selected with
// kubernetes.io/arch=arm64 like any arm64 workload, and as an x86-64 VM on
// the host's node; kubectl logs and port-forward reach the arm64 guest
// through its node's kubelet API.
func (e *podEnv) testArm64Guest(t *testing.T) {
	ctx := context.Background()
	armNode := e.a.name + "-arm64"
	n := waitNode(t, e.c, armNode, 60*time.Second, "Ready=True", readyIs(corev1.ConditionTrue))
	assert.Equal(t, "arm64", n.Labels[corev1.LabelArchStable])
	assert.Equal(t, "arm64", n.Status.NodeInfo.Architecture)
	assert.Equal(t, "tcg", n.Labels["qemu-kubelet.io/accelerator"])
	assert.Contains(t, n.Annotations["qemu-kubelet.io/accelerator-reason"], "KVM cannot run aarch64 guests")
	pods := n.Status.Capacity[corev1.ResourcePods]
	assert.Equal(t, int64(2), pods.Value())
	mainNode, err := e.c.Client().CoreV1().Nodes().Get(ctx, e.a.name, metav1.GetOptions{})
	require.NoError(t, err)
	assert.Equal(t, "amd64", mainNode.Labels[corev1.LabelArchStable])
	armCPU, mainCPU := n.Status.Capacity[corev1.ResourceCPU], mainNode.Status.Capacity[corev1.ResourceCPU]
	assert.Less(t, armCPU.MilliValue(), mainCPU.MilliValue(), "the arm64 node has its share (2 of 9 VMs) of the host's CPUs")

	multi := vmtest.PushIndex(t, e.reg, "multiarch", map[string]string{
		"amd64": e.refs[vmtest.VariantACPI],
		"arm64": vmtest.PushArchVariant(t, e.reg, "arm64", vmtest.VariantACPI),
	})
	archPod := func(name, arch string) *corev1.Pod {
		p := vmPodSpec(name, "", multi, corev1.RestartPolicyAlways, nil)
		p.Spec.NodeSelector = map[string]string{corev1.LabelArchStable: arch}
		return p
	}
	start := time.Now()
	arm := e.create(t, archPod("arm", "arm64"))
	x86 := e.create(t, archPod("x86", "amd64"))
	arm = waitPod(t, e.c, "default", arm.Name, 120*time.Second, "Running", podRunning)
	assert.Equal(t, armNode, arm.Spec.NodeName)
	armDir := filepath.Join(e.a.dir, "state", "arch", "arm64", "vms", string(arm.UID))
	waitFileContains(t, filepath.Join(armDir, qemu.ConsoleLogName), vmtest.BootMarker, 240*time.Second)
	t.Logf("arm64 pod (aarch64 TCG) created to boot marker: %s", time.Since(start).Round(100*time.Millisecond))
	x86 = waitPod(t, e.c, "default", x86.Name, 120*time.Second, "Running", podRunning)
	assert.Equal(t, e.a.name, x86.Spec.NodeName)
	e.waitBooted(t, x86)

	// kubectl logs goes through the arm64 node's kubelet API (its port).
	k := &kubectlEnv{t: t, c: e.c}
	out, err := k.run("logs", arm.Name)
	require.NoError(t, err, out)
	assert.Contains(t, out, "arch=aarch64", "an aarch64 kernel booted")
	assert.Regexp(t, `kernel=\S+-arm64`, out)
	out, err = k.run("logs", x86.Name)
	require.NoError(t, err, out)
	assert.Contains(t, out, "arch=x86_64", "the same multi-arch image is x86-64 on the host's node")
	for _, p := range []*corev1.Pod{arm, x86} {
		assert.True(t, strings.HasPrefix(p.Status.ContainerStatuses[0].ImageID, strings.TrimSuffix(multi, ":multiarch")+"@sha256:"), p.Status.ContainerStatuses[0].ImageID)
	}
	out, err = k.run("get", "pods", "arm", "x86", "-o", "wide")
	require.NoError(t, err)
	t.Logf("kubectl get pods -o wide:\n%s", out)

	l := testutil.FreePort(t)
	pf := k.start(nil, "port-forward", "pod/"+arm.Name, fmt.Sprintf("%d:8080", l))
	pf.waitFor(t, fmt.Sprintf("Forwarding from 127.0.0.1:%d", l), 30*time.Second)
	assert.NoError(t, httpExpect(fmt.Sprintf("http://127.0.0.1:%d/", l), "QK-HTTP-OK", 60*time.Second))
	pf.stop()

	// Delete: the arm64 guest powers off through the power button (gpio-keys)
	// within the grace period, like the x86 one through ACPI.
	rec := recordPod(t, e.c, "default", arm.Name)
	start = time.Now()
	_, err = e.c.Kubectl(ctx, "delete", "pod", arm.Name, x86.Name, "--wait=true", "--timeout=90s")
	require.NoError(t, err)
	t.Logf("delete of both took %s", time.Since(start).Round(time.Millisecond))
	assert.Contains(t, rec.seen(), "Succeeded/Completed", "terminal status after the arm64 guest powered off: %v", rec.seen())
	waitNoDir(t, armDir, 30*time.Second)
	waitNoDir(t, e.a.vmDir(string(x86.UID)), 30*time.Second)
}
