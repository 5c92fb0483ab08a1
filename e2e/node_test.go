package e2e

import (
	"context"
	"encoding/json"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/e2e/cluster"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
)

// TestNode runs the node-registration scenarios against one real control
// plane; each subtest uses its own node name and qemu-kubelet process.
func TestNode(t *testing.T) {
	prebuild(t, kubeletPkg) // under way while the control plane starts
	c := cluster.StartT(t, cluster.Options{})
	bin := buildQemuKubelet(t)

	t.Run("RegistersReadyAndDescribes", func(t *testing.T) { testRegistersReady(t, c, bin) })
	t.Run("AdminTaintAndCordonSurviveRestart", func(t *testing.T) { testTaintCordonSurviveRestart(t, c, bin) })
	t.Run("KilledGoesUnknownThenRecovers", func(t *testing.T) { testKillUnknownRecover(t, c, bin) })
	t.Run("KubeletAPIAuth", func(t *testing.T) { testKubeletAPIAuth(t, c, bin) })
	t.Run("BoundPodGetsClearStatus", func(t *testing.T) { testBoundPod(t, c, bin) })
}

func testRegistersReady(t *testing.T, c *cluster.Cluster, bin string) {
	ctx := context.Background()
	// prefer-kvm runs the real KVM probe: here KVM fails (nested), so the
	// node must say TCG and why.
	a := newNodeAgent(t, c, bin, "qk-register", "prefer-kvm", "labels: {pool: e2e}\n")
	a.start()
	n := waitNode(t, c, a.name, 90*time.Second, "Ready=True without lifecycle taints", readyAndSettled)

	ready := condition(n, corev1.NodeReady)
	assert.Equal(t, "KubeletReady", ready.Reason)
	assert.Contains(t, ready.Message, "accelerator")
	for _, typ := range []corev1.NodeConditionType{corev1.NodeMemoryPressure, corev1.NodeDiskPressure, corev1.NodePIDPressure} {
		cd := condition(n, typ)
		require.NotNil(t, cd, typ)
		assert.Equal(t, corev1.ConditionFalse, cd.Status, typ)
	}
	kvm := condition(n, "KVMAccelerated")
	require.NotNil(t, kvm)
	accel := n.Labels["qemu-kubelet.io/accelerator"]
	require.Contains(t, []string{"kvm", "tcg"}, accel)
	if accel == "tcg" {
		assert.Equal(t, corev1.ConditionFalse, kvm.Status)
		assert.Equal(t, "KVMProbeFailed", kvm.Reason)
		assert.Contains(t, n.Annotations["qemu-kubelet.io/accelerator-reason"], "falling back to TCG")
	} else {
		assert.Equal(t, corev1.ConditionTrue, kvm.Status)
	}

	assert.Equal(t, "e2e", n.Labels["pool"])
	assert.Equal(t, "virtual-kubelet", n.Labels["type"])
	assert.Equal(t, a.name, n.Labels["kubernetes.io/hostname"])
	assert.NotEmpty(t, n.Labels["kubernetes.io/arch"])
	assert.Equal(t, "linux", n.Labels["kubernetes.io/os"])
	assert.Equal(t, "qemu-vm-host", n.Labels["node.kubernetes.io/instance-type"])
	assert.Equal(t, []corev1.Taint{{Key: "virtual-kubelet.io/provider", Value: "qemu", Effect: corev1.TaintEffectNoSchedule}}, n.Spec.Taints)
	assert.True(t, strings.HasPrefix(n.Status.NodeInfo.ContainerRuntimeVersion, "qemu://"), n.Status.NodeInfo.ContainerRuntimeVersion)
	assert.NotEqual(t, "qemu://unknown", n.Status.NodeInfo.ContainerRuntimeVersion)
	assert.Equal(t, "v0.1.0-e2e", n.Status.NodeInfo.KubeletVersion)
	assert.NotEmpty(t, n.Status.NodeInfo.KernelVersion)
	assert.NotEmpty(t, n.Status.NodeInfo.OSImage)
	assert.Equal(t, int32(a.port), n.Status.DaemonEndpoints.KubeletEndpoint.Port)
	assert.Contains(t, n.Status.Addresses, corev1.NodeAddress{Type: corev1.NodeInternalIP, Address: a.ip})
	pods := n.Status.Capacity[corev1.ResourcePods]
	assert.Equal(t, int64(7), pods.Value())
	capMem, allocMem := n.Status.Capacity[corev1.ResourceMemory], n.Status.Allocatable[corev1.ResourceMemory]
	assert.Equal(t, int64(256<<20), capMem.Value()-allocMem.Value(), "allocatable = capacity - reserved")
	capCPU, allocCPU := n.Status.Capacity[corev1.ResourceCPU], n.Status.Allocatable[corev1.ResourceCPU]
	assert.Equal(t, int64(100), capCPU.MilliValue()-allocCPU.MilliValue())
	assert.Positive(t, n.Status.Capacity.StorageEphemeral().Value())

	// The node lease is held and renewed.
	lease, err := c.Client().CoordinationV1().Leases(corev1.NamespaceNodeLease).Get(ctx, a.name, metav1.GetOptions{})
	require.NoError(t, err, "node lease")
	require.NotNil(t, lease.Spec.HolderIdentity)
	assert.Equal(t, a.name, *lease.Spec.HolderIdentity)
	first := lease.Spec.RenewTime.Time
	require.NoError(t, wait.PollUntilContextTimeout(ctx, time.Second, 40*time.Second, false, func(ctx context.Context) (bool, error) {
		l, err := c.Client().CoordinationV1().Leases(corev1.NamespaceNodeLease).Get(ctx, a.name, metav1.GetOptions{})
		return err == nil && l.Spec.RenewTime.Time.After(first), nil
	}), "lease renewed")

	// What an admin sees, through the real kubectl.
	out, err := c.Kubectl(ctx, "describe", "node", a.name)
	require.NoError(t, err)
	t.Logf("kubectl describe node %s:\n%s", a.name, out)
	for _, want := range []string{
		"Taints:             virtual-kubelet.io/provider=qemu:NoSchedule",
		"Capacity:", "Allocatable:", "ephemeral-storage:", "pods:               7",
		"Conditions:", "MemoryPressure", "DiskPressure", "PIDPressure", "KubeletReady", "KVMAccelerated",
		"Container Runtime Version:  qemu://", "Kubelet Version:            v0.1.0-e2e",
		"Kernel Version:", "OS Image:", "InternalIP:  " + a.ip,
		"qemu-kubelet.io/accelerator=" + accel,
	} {
		assert.Contains(t, out, want)
	}
}

func testTaintCordonSurviveRestart(t *testing.T, c *cluster.Cluster, bin string) {
	ctx := context.Background()
	a := newNodeAgent(t, c, bin, "qk-restart", "tcg", "")
	a.start()
	waitNode(t, c, a.name, 60*time.Second, "Ready=True", readyIs(corev1.ConditionTrue))

	_, err := c.Kubectl(ctx, "taint", "node", a.name, "maintenance=planned:NoSchedule")
	require.NoError(t, err)
	_, err = c.Kubectl(ctx, "cordon", a.name)
	require.NoError(t, err)

	// Graceful stop: SIGTERM, clean exit.
	require.NoError(t, a.kill(syscall.SIGTERM), "qemu-kubelet exits 0 on SIGTERM")
	// Heartbeats have second resolution: restart in a later second than
	// any heartbeat of the first process.
	time.Sleep(time.Until(time.Now().Truncate(time.Second).Add(1100 * time.Millisecond)))
	restarted := time.Now().Truncate(time.Second)
	a.start()
	n := waitNode(t, c, a.name, 60*time.Second, "a status update from the restarted qemu-kubelet", func(n *corev1.Node) bool {
		r := condition(n, corev1.NodeReady)
		return r != nil && r.Status == corev1.ConditionTrue && !r.LastHeartbeatTime.Time.Before(restarted)
	})
	// Let a few status periods pass so any status/label push has happened.
	time.Sleep(5 * time.Second)
	n = waitNode(t, c, a.name, 10*time.Second, "still Ready", readyAndSettled)
	assert.True(t, n.Spec.Unschedulable, "cordon survives the restart")
	// The node-lifecycle controller adds node.kubernetes.io/unschedulable for
	// the cordon.
	assert.ElementsMatch(t, []string{"virtual-kubelet.io/provider=qemu:NoSchedule", "maintenance=planned:NoSchedule", "node.kubernetes.io/unschedulable=:NoSchedule"}, taintStrings(n.Spec.Taints))

	out, err := c.Kubectl(ctx, "get", "node", a.name)
	require.NoError(t, err)
	assert.Contains(t, out, "Ready,SchedulingDisabled")
}

func taintStrings(ts []corev1.Taint) []string {
	var out []string
	for _, t := range ts {
		out = append(out, t.Key+"="+t.Value+":"+string(t.Effect))
	}
	return out
}

func testKillUnknownRecover(t *testing.T, c *cluster.Cluster, bin string) {
	a := newNodeAgent(t, c, bin, "qk-kill", "tcg", "")
	a.start()
	waitNode(t, c, a.name, 60*time.Second, "Ready=True", readyIs(corev1.ConditionTrue))

	_ = a.kill(syscall.SIGKILL)
	// Grace period 20s + monitor period: the node-lifecycle controller marks
	// the node Unknown and taints it unreachable.
	n := waitNode(t, c, a.name, 90*time.Second, "Ready=Unknown after SIGKILL", readyIs(corev1.ConditionUnknown))
	assert.Equal(t, "NodeStatusUnknown", condition(n, corev1.NodeReady).Reason)
	n = waitNode(t, c, a.name, 30*time.Second, "unreachable taint", func(n *corev1.Node) bool {
		for _, tn := range n.Spec.Taints {
			if tn.Key == corev1.TaintNodeUnreachable {
				return true
			}
		}
		return false
	})

	a.start()
	n = waitNode(t, c, a.name, 60*time.Second, "Ready=True after restart", readyIs(corev1.ConditionTrue))
	assert.Equal(t, "KubeletReady", condition(n, corev1.NodeReady).Reason)
	waitNode(t, c, a.name, 60*time.Second, "unreachable taint removed", func(n *corev1.Node) bool {
		for _, tn := range n.Spec.Taints {
			if tn.Key == corev1.TaintNodeUnreachable {
				return false
			}
		}
		return true
	})
}

func testKubeletAPIAuth(t *testing.T, c *cluster.Cluster, bin string) {
	ctx := context.Background()
	a := newNodeAgent(t, c, bin, "qk-auth", "tcg", "")
	a.start()
	waitNode(t, c, a.name, 60*time.Second, "Ready=True", readyIs(corev1.ConditionTrue))

	// No credentials: 401.
	code, body := a.kubeletGet(t, "/pods", a.kubeletTLS(t, ""), "")
	assert.Equal(t, http.StatusUnauthorized, code, body)
	code, _ = a.kubeletGet(t, "/runningpods/", a.kubeletTLS(t, ""), "")
	assert.Equal(t, http.StatusUnauthorized, code)
	code, _ = a.kubeletGet(t, "/pods", a.kubeletTLS(t, ""), "not-a-token")
	assert.Equal(t, http.StatusUnauthorized, code, "an invalid bearer token is refused by TokenReview")

	// The admin through the API server's node proxy (the API server
	// authenticates to the kubelet with its kubelet client certificate).
	out, err := c.Kubectl(ctx, "get", "--raw", "/api/v1/nodes/"+a.name+"/proxy/pods")
	require.NoError(t, err)
	var list corev1.PodList
	require.NoError(t, json.Unmarshal([]byte(out), &list), out)
	out, err = c.Kubectl(ctx, "get", "--raw", "/api/v1/nodes/"+a.name+"/proxy/stats/summary")
	require.NoError(t, err)
	assert.Contains(t, out, a.name)

	// A user without RBAC: 403 at the API server's proxy, and 403 from the
	// kubelet itself (authenticated by client cert, denied by
	// SubjectAccessReview).
	nobody, err := c.UserKubeconfig("nobody")
	require.NoError(t, err)
	cmd := exec.Command(c.KubectlPath(), "--kubeconfig", nobody, "get", "--raw", "/api/v1/nodes/"+a.name+"/proxy/pods")
	b, err := cmd.CombinedOutput()
	require.Error(t, err)
	assert.Contains(t, string(b), "forbidden")
	code, body = a.kubeletGet(t, "/pods", a.kubeletTLS(t, nobody), "")
	assert.Equal(t, http.StatusForbidden, code, body)

	// Bearer token of a service account: TokenReview authenticates it,
	// SubjectAccessReview denies it, then allows it once RBAC grants
	// nodes/proxy.
	ns := "default"
	_, err = c.Client().CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "node-reader"}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		require.NoError(t, err)
	}
	tr, err := c.Client().CoreV1().ServiceAccounts(ns).CreateToken(ctx, "node-reader", &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{}}, metav1.CreateOptions{})
	require.NoError(t, err)
	code, body = a.kubeletGet(t, "/pods", a.kubeletTLS(t, ""), tr.Status.Token)
	assert.Equal(t, http.StatusForbidden, code, body)

	_, err = c.Client().RbacV1().ClusterRoles().Create(ctx, &rbacv1.ClusterRole{
		ObjectMeta: metav1.ObjectMeta{Name: "qk-e2e-node-proxy"},
		Rules:      []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"nodes/proxy"}, Verbs: []string{"get"}}},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	_, err = c.Client().RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "qk-e2e-node-proxy"},
		RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: "qk-e2e-node-proxy"},
		Subjects:   []rbacv1.Subject{{Kind: "User", Name: "reader"}},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	reader, err := c.UserKubeconfig("reader")
	require.NoError(t, err)
	// The kubelet caches denials for 30s; this user was never asked before.
	require.NoError(t, wait.PollUntilContextTimeout(ctx, time.Second, 30*time.Second, true, func(context.Context) (bool, error) {
		code, _ = a.kubeletGet(t, "/pods", a.kubeletTLS(t, reader), "")
		return code == http.StatusOK, nil
	}), "user with nodes/proxy reaches the kubelet API directly (last code %d)", code)
}

func testBoundPod(t *testing.T, c *cluster.Cluster, bin string) {
	ctx := context.Background()
	a := newNodeAgent(t, c, bin, "qk-pod", "tcg", "")
	a.start()
	waitNode(t, c, a.name, 60*time.Second, "Ready=True", readyIs(corev1.ConditionTrue))

	ns := "default"
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "vm-unsupported", Namespace: ns},
		Spec: corev1.PodSpec{
			NodeSelector: map[string]string{"kubernetes.io/hostname": a.name},
			Tolerations:  []corev1.Toleration{{Key: "virtual-kubelet.io/provider", Operator: corev1.TolerationOpEqual, Value: "qemu", Effect: corev1.TaintEffectNoSchedule}},
			// A VM pod has no init containers: refused with a clear status.
			InitContainers: []corev1.Container{{Name: "init", Image: "example.invalid/init:1"}},
			Containers:     []corev1.Container{{Name: "vm", Image: "example.invalid/os:1"}},
		},
	}
	_, err := c.Client().CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{})
	require.NoError(t, err)
	t.Cleanup(func() {
		zero := int64(0)
		_ = c.Client().CoreV1().Pods(ns).Delete(context.Background(), pod.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero})
	})

	var got *corev1.Pod
	err = wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
		p, err := c.Client().CoreV1().Pods(ns).Get(ctx, pod.Name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		got = p
		return p.Status.Phase == corev1.PodFailed, nil
	})
	require.NoError(t, err, "pod reaches Failed (last status %+v)", got)
	assert.Equal(t, a.name, got.Spec.NodeName, "scheduled to the virtual node")
	assert.Equal(t, "UnsupportedPodSpec", got.Status.Reason)
	assert.Contains(t, got.Status.Message, "spec.initContainers: not supported")
	require.Len(t, got.Status.ContainerStatuses, 1)
	require.NotNil(t, got.Status.ContainerStatuses[0].State.Terminated)
	assert.Equal(t, "UnsupportedPodSpec", got.Status.ContainerStatuses[0].State.Terminated.Reason)

	out, err := c.Kubectl(ctx, "get", "pod", "-n", ns, pod.Name)
	require.NoError(t, err)
	assert.Contains(t, out, "UnsupportedPodSpec")

	// The provider reports exactly this pod.
	out, err = c.Kubectl(ctx, "get", "--raw", "/api/v1/nodes/"+a.name+"/proxy/runningpods/")
	require.NoError(t, err)
	var running corev1.PodList
	require.NoError(t, json.Unmarshal([]byte(out), &running), out)
	require.Len(t, running.Items, 1)
	assert.Equal(t, pod.Name, running.Items[0].Name)
	assert.Equal(t, got.UID, running.Items[0].UID)

	// Deleting it (normal grace) removes it from the API server and the
	// provider forgets it.
	require.NoError(t, c.Client().CoreV1().Pods(ns).Delete(ctx, pod.Name, metav1.DeleteOptions{}))
	require.NoError(t, wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
		_, err := c.Client().CoreV1().Pods(ns).Get(ctx, pod.Name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	}), "pod deleted")
	require.NoError(t, wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		out, err := c.Kubectl(ctx, "get", "--raw", "/api/v1/nodes/"+a.name+"/proxy/runningpods/")
		if err != nil {
			return false, nil
		}
		var l corev1.PodList
		return json.Unmarshal([]byte(out), &l) == nil && len(l.Items) == 0, nil
	}), "provider forgot the deleted pod")
}

// TestNodeInvalidConfig needs no cluster: a bad config file fails before
// any API server contact, with a message naming the field.
func TestNodeInvalidConfig(t *testing.T) {
	bin := buildQemuKubelet(t)
	tests := []struct {
		name, body string
		want       []string
	}{
		{"negative reserved memory", "reserved: {memory: -1Gi}\n", []string{"reserved[memory]", "must not be negative"}},
		{"unknown field", "maxVM: 3\n", []string{`unknown field "maxVM"`}},
		{"bad policy", "accelerator: {policy: fast}\n", []string{"accelerator.policy"}},
		{"bad port", "server: {port: 99999}\n", []string{"server.port"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			p := filepath.Join(dir, "node.yaml")
			require.NoError(t, os.WriteFile(p, []byte("apiVersion: qemu-kubelet.io/v1alpha1\nkind: NodeConfiguration\nstateDir: "+dir+"/state\n"+tt.body), 0o600))
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			// A kubeconfig pointing nowhere: the process must fail on the
			// config before it would try to connect.
			cmd := exec.CommandContext(ctx, bin, "--config", p, "--kubeconfig", filepath.Join(dir, "missing-kubeconfig"))
			out, err := cmd.CombinedOutput()
			assert.Equal(t, 1, exitCode(err), "exit code; output:\n%s", out)
			for _, w := range tt.want {
				assert.Contains(t, string(out), w)
			}
			assert.Contains(t, string(out), p, "message names the file")
			_, statErr := os.Stat(filepath.Join(dir, "state"))
			assert.True(t, os.IsNotExist(statErr), "nothing created before the config is valid")
		})
	}
}
