package charts

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/qemu-kubelet/qemu-kubelet/e2e/cluster"
	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
)

// TestAgainstAPIServer applies the chart to a real kube-apiserver (built
// from source by hack/build-control-plane.sh): a server-side dry-run of
// every values file, then a real install in which qemu-kubelet and the
// exporterset-controller run as the chart's ServiceAccounts, so the RBAC
// the chart grants is proved sufficient by the real binaries.
func TestAgainstAPIServer(t *testing.T) {
	testutil.SkipIfShort(t, "a control plane")
	c := cluster.StartT(t, cluster.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	kubectl := func(t *testing.T, args ...string) string {
		t.Helper()
		out, err := c.Kubectl(ctx, args...)
		require.NoError(t, err)
		return out
	}
	t.Run("helm install and uninstall", func(t *testing.T) {
		// Helm itself installs the chart (CRDs from crds/ first) into the
		// real API server, prints NOTES.txt, and uninstalls it again.
		const ns = "helm-it"
		kc := "--kubeconfig=" + c.AdminKubeconfig()
		out, stderr, err := runHelm(t, "install", "h", chartDir, kc, "-n", ns, "--create-namespace", "--set", "runtimeClass.name=qemu-h")
		require.NoError(t, err, "helm install: %s%s", out, stderr)
		assert.Contains(t, out, "STATUS: deployed")
		assert.Contains(t, out, "kubectl label node <host> qemu-kubelet.io/kvm-host=true", "NOTES.txt")
		assert.Contains(t, out, "runtimeClassName: qemu-h", "NOTES.txt")
		_, err = c.Kubectl(ctx, "get", "crd", "exportersets.qemu-kubelet.io")
		require.NoError(t, err, "helm installed the CRD")
		for _, o := range []string{"deployment/h-qemu-kubelet-controller", "daemonset/h-qemu-kubelet-node", "configmap/h-qemu-kubelet-node-config"} {
			_, err := c.Kubectl(ctx, "get", "-n", ns, o)
			assert.NoError(t, err, "%s installed", o)
		}
		_, err = c.Kubectl(ctx, "get", "runtimeclass", "qemu-h")
		require.NoError(t, err)
		out, stderr, err = runHelm(t, "uninstall", "h", kc, "-n", ns, "--wait")
		require.NoError(t, err, "helm uninstall: %s%s", out, stderr)
		for _, o := range []string{"runtimeclass/qemu-h", "clusterrole/h-qemu-kubelet-node", "role/h-qemu-kubelet-node-lease -n kube-node-lease"} {
			out, err := c.Kubectl(ctx, append([]string{"get"}, strings.Fields(o)...)...)
			assert.Error(t, err, "%s left behind: %s", o, out)
		}
		_, err = c.Kubectl(ctx, "get", "crd", "exportersets.qemu-kubelet.io")
		assert.NoError(t, err, "Helm keeps CRDs on uninstall")
	})

	// CRDs first, server-side (again: the same objects, now also owned by
	// kubectl's field manager): the ExporterSet CRD (a whole PodTemplateSpec)
	// is too large for the last-applied annotation of a client-side apply.
	// The Prometheus Operator's own ServiceMonitor and PodMonitor CRDs
	// (from its Go module, hack/fetch-monitoring-crds.sh) let the monitors
	// of ci/monitoring-values.yaml be dry-run against their real schemas.
	kubectl(t, "apply", "--server-side", "-f", filepath.Join(chartDir, "crds"))
	kubectl(t, "apply", "--server-side", "-f", monitoringCRDs(t))
	kubectl(t, "wait", "--for=condition=Established", "--timeout=60s",
		"crd/exportersets.qemu-kubelet.io", "crd/virtualtargetclasses.qemu-kubelet.io", "crd/servicemonitors.monitoring.coreos.com", "crd/podmonitors.monitoring.coreos.com")
	kubectl(t, "create", "namespace", releaseNS)
	kubectl(t, "create", "namespace", "labs") // ci/controller-only-values.yaml watches it

	t.Run("dry-run", func(t *testing.T) {
		for _, f := range append([]string{""}, ciValues(t)...) {
			t.Run(caseName(f), func(t *testing.T) {
				manifest := render(t, f)
				n := len(objects(t, manifest))
				path := filepath.Join(t.TempDir(), "rendered.yaml")
				require.NoError(t, os.WriteFile(path, []byte(manifest), 0o600))
				out := kubectl(t, "apply", "--server-side", "--dry-run=server", "--field-manager=chart-test", "-f", path)
				assert.Equal(t, n, strings.Count(out, "serverside-applied (server dry run)"), "every object dry-run applied:\n%s", out)
			})
		}
	})

	t.Run("dry-run rejects an invalid manifest", func(t *testing.T) {
		// The dry-run is a real check: a field the API does not know fails.
		manifest := render(t, "")
		bad := strings.Replace(manifest, "      hostNetwork: false\n", "      hostNetwork: false\n      hostNetwrok: true\n", 1)
		require.NotEqual(t, manifest, bad)
		path := filepath.Join(t.TempDir(), "bad.yaml")
		require.NoError(t, os.WriteFile(path, []byte(bad), 0o600))
		out, err := c.Kubectl(ctx, "apply", "--server-side", "--dry-run=server", "-f", path)
		require.Error(t, err)
		assert.Contains(t, out, "hostNetwrok")

		// And the monitors are checked against the real Prometheus Operator
		// schemas, not a permissive stand-in.
		manifest = render(t, filepath.Join(chartDir, "ci", "monitoring-values.yaml"))
		bad = strings.Replace(manifest, "podMetricsEndpoints:", "podMetricEndpoints:", 1)
		require.NotEqual(t, manifest, bad)
		require.NoError(t, os.WriteFile(path, []byte(bad), 0o600))
		out, err = c.Kubectl(ctx, "apply", "--server-side", "--dry-run=server", "-f", path)
		require.Error(t, err)
		assert.Contains(t, out, "podMetricEndpoints")
	})

	t.Run("binaries run with the chart's RBAC", func(t *testing.T) {
		installAndRun(ctx, t, c)
	})
}

func installAndRun(ctx context.Context, t *testing.T, c *cluster.Cluster) {
	root, err := cluster.RepoRoot()
	require.NoError(t, err)
	bins := t.TempDir()
	build := exec.CommandContext(ctx, "go", "build", "-o", bins+"/", "./cmd/qemu-kubelet", "./cmd/exporterset-controller")
	build.Dir = root
	out, err := build.CombinedOutput()
	require.NoError(t, err, "go build: %s", out)

	ip := testutil.HostIPv4(t)
	port := testutil.FreePort(t)
	// QEMU runs as the chart's vmUser (107): it searches its way there.
	state := filepath.Join(testutil.Searchable(t, t.TempDir()), "state")
	const nodeName = "qemu-host1"
	manifest := render(t, "",
		"nodeAgent.stateDir="+state,
		"nodeAgent.config.nodeIP="+ip,
		"nodeAgent.config.server.address="+ip,
		fmt.Sprintf("nodeAgent.config.server.port=%d", port),
		"nodeAgent.config.server.clientCAFile="+c.CAFile(),
		"nodeAgent.config.accelerator.policy=tcg",
		"nodeAgent.config.nodeStatusUpdateFrequency=2s",
	)
	objs := objects(t, manifest)
	path := filepath.Join(t.TempDir(), "rendered.yaml")
	require.NoError(t, os.WriteFile(path, []byte(manifest), 0o600))
	_, err = c.Kubectl(ctx, "apply", "--server-side", "--field-manager=chart-test", "-f", path)
	require.NoError(t, err)

	// The node agent, with the config the chart renders into its
	// ConfigMap, authenticated as the chart's node ServiceAccount.
	raw, _ := nodeConfig(t, objs)
	cfgPath := filepath.Join(t.TempDir(), "config.yaml")
	require.NoError(t, os.WriteFile(cfgPath, []byte(raw), 0o600))
	agentKC := saKubeconfig(t, c, releaseNS, "t-qemu-kubelet-node")
	agentLog := start(t, filepath.Join(bins, "qemu-kubelet"), "--config="+cfgPath, "--kubeconfig="+agentKC, "--node-name="+nodeName, "-v=2")

	// The controller, as the chart's controller ServiceAccount, with the
	// chart's leader election arguments.
	ctrlKC := saKubeconfig(t, c, releaseNS, "t-qemu-kubelet-controller")
	ctrlLog := start(t, filepath.Join(bins, "exporterset-controller"), "--kubeconfig="+ctrlKC,
		"--leader-elect=true", "--leader-election-namespace="+releaseNS, "--leader-election-id=exporterset-controller.qemu-kubelet.io",
		"--metrics-bind-address=0", "--health-probe-bind-address=0", "-v=2")
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("qemu-kubelet log:\n%s", tailFile(agentLog, 40))
			t.Logf("exporterset-controller log:\n%s", tailFile(ctrlLog, 40))
		}
	})

	client := c.Client()
	poll := func(what string, timeout time.Duration, f func(ctx context.Context) (bool, error)) {
		t.Helper()
		err := wait.PollUntilContextTimeout(ctx, time.Second, timeout, true, f)
		require.NoError(t, err, "waiting for %s", what)
	}
	poll("node "+nodeName+" Ready", 3*time.Minute, func(ctx context.Context) (bool, error) {
		n, err := client.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		for _, cond := range n.Status.Conditions {
			if cond.Type == corev1.NodeReady {
				return cond.Status == corev1.ConditionTrue, nil
			}
		}
		return false, nil
	})
	var lease *coordinationv1.Lease
	poll("node lease", time.Minute, func(ctx context.Context) (bool, error) {
		lease, err = client.CoordinationV1().Leases("kube-node-lease").Get(ctx, nodeName, metav1.GetOptions{})
		return err == nil, nil
	})
	assert.Equal(t, nodeName, *lease.Spec.HolderIdentity)

	// The kubelet API authorizes the API server's proxy request through a
	// SubjectAccessReview made with the agent's RBAC.
	raw, err = c.Kubectl(ctx, "get", "--raw", "/api/v1/nodes/"+nodeName+"/proxy/pods")
	require.NoError(t, err, "kubelet API through the apiserver proxy")
	assert.Contains(t, raw, `"kind":"PodList"`)

	// A VM pool using the chart's RuntimeClass: admission merges its
	// overhead, node selector and toleration into the pods, the scheduler
	// binds them to the virtual node, and the agent reports their status.
	exs := `apiVersion: qemu-kubelet.io/v1alpha1
kind: ExporterSet
metadata: {name: pool, namespace: default}
spec:
  replicas: 2
  selector: {matchLabels: {app: pool}}
  template:
    metadata: {labels: {app: pool}}
    spec:
      runtimeClassName: qemu
      imagePullSecrets: [{name: regcred}]
      containers:
      - name: vm
        image: 127.0.0.1:1/none/test-os:latest
        resources: {limits: {cpu: 100m, memory: 64Mi}}
`
	// The agent reads the pods' pull secret with the chart's RBAC (a refusal
	// would show as "forbidden" in its log, checked below).
	_, err = c.Kubectl(ctx, "create", "secret", "docker-registry", "regcred", "-n", "default",
		"--docker-server=127.0.0.1:1", "--docker-username=u", "--docker-password=p")
	require.NoError(t, err)
	w, err := client.CoreV1().Pods("default").Watch(ctx, metav1.ListOptions{LabelSelector: "app=pool"})
	require.NoError(t, err)
	defer w.Stop()
	exsPath := filepath.Join(t.TempDir(), "exs.yaml")
	require.NoError(t, os.WriteFile(exsPath, []byte(exs), 0o600))
	_, err = c.Kubectl(ctx, "apply", "--server-side", "-f", exsPath)
	require.NoError(t, err)

	// The agent rejects VM pods until the provider lands and the controller
	// replaces failed pods, so pods come and go within a second: watch and
	// collect every pool pod seen bound to the virtual node with a status
	// written by the agent.
	seen := map[string]corev1.Pod{}
	wctx, wcancel := context.WithTimeout(ctx, 3*time.Minute)
	defer wcancel()
	for len(seen) < 2 {
		select {
		case ev, ok := <-w.ResultChan():
			require.True(t, ok, "pod watch ended; seen %d pods bound to %s with an agent status", len(seen), nodeName)
			if p, isPod := ev.Object.(*corev1.Pod); isPod && p.Spec.NodeName == nodeName && (p.Status.Reason != "" || len(p.Status.ContainerStatuses) > 0) {
				seen[p.Name] = *p
			}
		case <-wctx.Done():
			t.Fatalf("after 3m: %d pool pods seen bound to %s with a status from the agent, want 2", len(seen), nodeName)
		}
	}
	for _, p := range seen {
		assert.True(t, p.Spec.Overhead.Memory().Equal(resource.MustParse("128Mi")), "pod %s overhead memory %v", p.Name, p.Spec.Overhead)
		assert.True(t, p.Spec.Overhead.Cpu().Equal(resource.MustParse("100m")), "pod %s overhead cpu %v", p.Name, p.Spec.Overhead)
		assert.Equal(t, "virtual-kubelet", p.Spec.NodeSelector["type"])
		assert.Contains(t, p.Spec.Tolerations, corev1.Toleration{Key: "virtual-kubelet.io/provider", Operator: corev1.TolerationOpEqual, Value: "qemu", Effect: corev1.TaintEffectNoSchedule})
		assert.NotEmpty(t, p.OwnerReferences, "pod %s created by the controller", p.Name)
	}
	// The controller writes status with the chart's exportersets/status rule.
	poll("ExporterSet status from the controller", time.Minute, func(ctx context.Context) (bool, error) {
		out, err := c.Kubectl(ctx, "get", "exporterset", "pool", "-n", "default", "-o", "jsonpath={.status.observedGeneration}")
		return err == nil && strings.TrimSpace(out) == "1", nil
	})
	// Leader election used the Lease the chart's Role allows.
	_, err = client.CoordinationV1().Leases(releaseNS).Get(ctx, "exporterset-controller.qemu-kubelet.io", metav1.GetOptions{})
	require.NoError(t, err, "leader election lease")

	// Neither binary was refused anything.
	for name, log := range map[string]string{"qemu-kubelet": agentLog, "exporterset-controller": ctrlLog} {
		b, err := os.ReadFile(log)
		require.NoError(t, err)
		refused := grepLines(string(b), "forbidden")
		assert.Empty(t, refused, "%s was refused API requests", name)
	}
	// And the agent cannot do what it does not need.
	for _, deny := range [][]string{
		{"list", "secrets"}, {"watch", "secrets"}, {"get", "configmaps"}, {"delete", "nodes"}, {"create", "pods"},
		{"update", "leases", "-n", "kube-system"},
	} {
		out, _ := c.Kubectl(ctx, append([]string{"auth", "can-i", "--as=system:serviceaccount:" + releaseNS + ":t-qemu-kubelet-node"}, deny...)...)
		assert.Equal(t, "no", lastLine(out), "node agent can %v", deny)
	}
	// What the controller may and may not do.
	ctrlSA := "--as=system:serviceaccount:" + releaseNS + ":t-qemu-kubelet-controller"
	for _, q := range []struct {
		args []string
		want string
	}{
		{[]string{"update", "exportersets.qemu-kubelet.io", "--subresource=status", "-n", "default"}, "yes"},
		{[]string{"delete", "pods", "-n", "default"}, "yes"},
		{[]string{"update", "exportersets.qemu-kubelet.io", "-n", "default"}, "no"},
		{[]string{"patch", "exportersets.qemu-kubelet.io", "-n", "default"}, "yes"},
		{[]string{"watch", "virtualtargetclasses.qemu-kubelet.io", "-n", "default"}, "yes"},
		{[]string{"update", "virtualtargetclasses.qemu-kubelet.io", "-n", "default"}, "no"},
		{[]string{"list", "secrets"}, "no"},
		{[]string{"update", "leases.coordination.k8s.io", "-n", "kube-system"}, "no"},
	} {
		out, _ := c.Kubectl(ctx, append([]string{"auth", "can-i", ctrlSA}, q.args...)...)
		assert.Equal(t, q.want, lastLine(out), "controller can-i %v", q.args)
	}
}

// monitoringCRDs runs hack/fetch-monitoring-crds.sh and returns its directory.
func monitoringCRDs(t *testing.T) string {
	t.Helper()
	root, err := cluster.RepoRoot()
	require.NoError(t, err)
	cmd := exec.Command(filepath.Join(root, "hack", "fetch-monitoring-crds.sh"))
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	require.NoError(t, err, "hack/fetch-monitoring-crds.sh")
	return strings.TrimSpace(string(out))
}

// saKubeconfig writes a client-certificate kubeconfig whose user is the
// ServiceAccount's user name: RBAC bindings to a ServiceAccount match it
// exactly as they match the account's tokens.
func saKubeconfig(t *testing.T, c *cluster.Cluster, ns, name string) string {
	t.Helper()
	kc, err := c.UserKubeconfig("system:serviceaccount:"+ns+":"+name, "system:serviceaccounts", "system:serviceaccounts:"+ns)
	require.NoError(t, err)
	return kc
}

// start runs a binary in its own process group, logging to a file; the
// whole group is killed when the test ends.
func start(t *testing.T, bin string, args ...string) (logPath string) {
	t.Helper()
	logPath = filepath.Join(t.TempDir(), filepath.Base(bin)+".log")
	logf, err := os.Create(logPath)
	require.NoError(t, err)
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	require.NoError(t, cmd.Start(), "start %s", bin)
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); logf.Close(); close(done) }()
	t.Cleanup(func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			<-done
		}
	})
	return logPath
}

func tailFile(path string, n int) string {
	b, _ := os.ReadFile(path)
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(strings.ToLower(l), sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

func caseName(valuesFile string) string {
	if valuesFile == "" {
		return "defaults"
	}
	return filepath.Base(valuesFile)
}

// lastLine is kubectl's answer without the warnings before it.
func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return strings.TrimSpace(lines[len(lines)-1])
}
