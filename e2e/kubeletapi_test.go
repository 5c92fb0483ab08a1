package e2e

import (
	"bytes"
	"context"
	"crypto/md5"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/e2e/cluster"
	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/oci/ocitest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/vmtest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/rest"
	statsv1alpha1 "k8s.io/kubelet/pkg/apis/stats/v1alpha1"
	"k8s.io/utils/ptr"
)

// TestKubeletAPI drives a VM pod through the real kubectl against a real
// control plane: the API server proxies logs, attach, exec, port-forward
// and stats to qemu-kubelet's kubelet API.
func TestKubeletAPI(t *testing.T) {
	prebuild(t, kubeletPkg) // under way while the control plane starts
	c := cluster.StartT(t, cluster.Options{})
	reg := ocitest.StartRegistry(t, ocitest.RegistryOptions{})
	refs := vmtest.PushTestImages(t, reg.Addr)
	bin := buildQemuKubelet(t)
	a := newNodeAgent(t, c, bin, "qk-api", "tcg", "")
	vmtest.ReapQEMU(t, a.dir)
	t.Cleanup(func() { deleteAllPods(t, c, "default", a.dir) })
	a.start()
	waitNode(t, c, a.name, 90*time.Second, "Ready=True", readyIs(corev1.ConditionTrue))

	spec := vmPodSpec("kapi", a.name, refs[vmtest.VariantACPI], corev1.RestartPolicyAlways, nil)
	spec.Spec.Containers[0].Stdin = true
	spec.Spec.Containers[0].TTY = true
	pod, err := c.Client().CoreV1().Pods("default").Create(context.Background(), spec, metav1.CreateOptions{})
	require.NoError(t, err)
	pod = waitPod(t, c, "default", pod.Name, 120*time.Second, "Running", podRunning)
	k := &kubectlEnv{t: t, c: c}

	t.Run("LogsShowBootMarker", func(t *testing.T) {
		k.t = t
		out := k.eventually(90*time.Second, vmtest.BootMarker, "logs", "kapi")
		assert.Contains(t, out, vmtest.BootMarker)
		out = k.ok("logs", "kapi", "-c", "vm", "--tail=1")
		assert.Equal(t, 1, strings.Count(strings.TrimRight(out, "\n"), "\n")+1, "--tail=1 gives one line: %q", out)
		out = k.ok("logs", "kapi", "--limit-bytes=5")
		assert.Len(t, out, 5)
		out = k.ok("logs", "kapi", "--timestamps", "--tail=1")
		_, perr := time.Parse(time.RFC3339Nano, strings.Fields(out)[0])
		assert.NoError(t, perr, "--timestamps prefixes an RFC 3339 time: %q", out)
		out = k.ok("logs", "kapi", "--since=1h")
		assert.Contains(t, out, vmtest.BootMarker)
		out, err := k.run("logs", "kapi", "-c", "nope")
		assert.Error(t, err)
		assert.Contains(t, out, "nope")
	})

	t.Run("LogsOfAPodThatNeverStarted", func(t *testing.T) {
		k.t = t
		ctx := context.Background()
		p := vmPodSpec("never", a.name, reg.Addr+"/"+vmtest.Repo+":missing", corev1.RestartPolicyAlways, nil)
		_, err := c.Client().CoreV1().Pods("default").Create(ctx, p, metav1.CreateOptions{})
		require.NoError(t, err)
		waitPod(t, c, "default", "never", 60*time.Second, "image pull failing", func(p *corev1.Pod) bool {
			cs := p.Status.ContainerStatuses
			return len(cs) == 1 && cs[0].State.Waiting != nil && strings.Contains(cs[0].State.Waiting.Reason, "ImagePull")
		})
		out, err := k.run("logs", "never")
		require.Error(t, err)
		assert.Contains(t, out, `container "vm" in pod "never" is waiting to start: `)
		assert.Contains(t, out, "ImagePull")
		require.NoError(t, c.Client().CoreV1().Pods("default").Delete(ctx, "never", metav1.DeleteOptions{}))
		waitPodGone(t, c, "default", "never", 60*time.Second)
	})

	t.Run("ExecThroughGuestAgent", func(t *testing.T) {
		k.t = t
		out := k.ok("exec", "kapi", "--", "uname", "-m")
		assert.Equal(t, "x86_64\n", out, "the guest's answer")

		cmd := exec.Command(c.KubectlPath(), "--kubeconfig="+c.AdminKubeconfig(), "exec", "-i", "kapi", "--", "tr", "a-z", "A-Z")
		cmd.Stdin = strings.NewReader("typed into stdin\n")
		b, err := cmd.Output()
		require.NoError(t, err)
		assert.Equal(t, "TYPED INTO STDIN\n", string(b))

		out, err = k.run("exec", "kapi", "--", "sh", "-c", "echo to-stderr >&2; exit 3")
		var ee *exec.ExitError
		require.ErrorAs(t, err, &ee, out)
		assert.Equal(t, 3, ee.ExitCode(), "kubectl exits with the guest command's code: %s", out)
		assert.Contains(t, out, "to-stderr")

		// -it on a real terminal (a pty; without one kubectl drops -t).
		tty, _ := k.startTTY("exec", "-it", "kapi", "--", "sh")
		tty.waitFor(t, "tty (kubectl exec -t) is not supported", 30*time.Second)
		select {
		case <-tty.done:
		case <-time.After(30 * time.Second):
			t.Fatalf("kubectl exec -it did not end after the refusal:\n%s", tail(tty.output(), 20))
		}
		assert.NotEqual(t, 0, tty.cmd.ProcessState.ExitCode())
	})

	t.Run("ExecWithoutGuestAgentFailsClearly", func(t *testing.T) {
		k.t = t
		ctx := context.Background()
		p := vmPodSpec("noagent", a.name, refs[vmtest.VariantACPI], corev1.RestartPolicyAlways, map[string]string{"qemu-kubelet.io/kernel-cmdline": "qk.noagent"})
		_, err := c.Client().CoreV1().Pods("default").Create(ctx, p, metav1.CreateOptions{})
		require.NoError(t, err)
		waitPod(t, c, "default", "noagent", 120*time.Second, "Running", podRunning)
		k.eventually(90*time.Second, "QK-AGENT-OFF", "logs", "noagent")
		out, err := k.run("exec", "noagent", "--", "uname", "-m")
		require.Error(t, err)
		assert.Contains(t, out, "guest agent not responding on VM")
		assert.Contains(t, out, "the image runs no qemu-guest-agent")
		require.NoError(t, c.Client().CoreV1().Pods("default").Delete(ctx, "noagent", metav1.DeleteOptions{}))
		waitPodGone(t, c, "default", "noagent", 90*time.Second)
	})

	t.Run("StatsSummaryHasPodCPUAndMemory", func(t *testing.T) {
		k.t = t
		raw := k.ok("get", "--raw", "/api/v1/nodes/"+a.name+"/proxy/stats/summary")
		var s statsv1alpha1.Summary
		require.NoError(t, json.Unmarshal([]byte(raw), &s), raw)
		assert.Equal(t, a.name, s.Node.NodeName)
		require.NotNil(t, s.Node.CPU)
		require.NotNil(t, s.Node.Memory)
		var ps *statsv1alpha1.PodStats
		for i := range s.Pods {
			if s.Pods[i].PodRef.Name == "kapi" {
				ps = &s.Pods[i]
			}
		}
		require.NotNil(t, ps, "pod kapi in %s", raw)
		assert.Equal(t, string(pod.UID), ps.PodRef.UID)
		require.NotNil(t, ps.CPU.UsageCoreNanoSeconds)
		assert.Greater(t, *ps.CPU.UsageCoreNanoSeconds, uint64(time.Second), "a TCG boot costs more than 1s of CPU")
		require.NotNil(t, ps.CPU.UsageNanoCores)
		require.NotNil(t, ps.Memory.WorkingSetBytes)
		assert.Greater(t, *ps.Memory.WorkingSetBytes, uint64(20<<20), "QEMU's resident memory")
		require.Len(t, ps.Containers, 1)
		assert.Equal(t, "vm", ps.Containers[0].Name)

		m := k.ok("get", "--raw", "/api/v1/nodes/"+a.name+"/proxy/metrics/resource")
		assert.Contains(t, m, `container_cpu_usage_seconds_total{container="vm",namespace="default",pod="kapi"}`)
		assert.Contains(t, m, `container_memory_working_set_bytes{container="vm",namespace="default",pod="kapi"}`)
		assert.Contains(t, m, "node_cpu_usage_seconds_total ")
		assert.Contains(t, m, "resource_scrape_error 0")
	})

	t.Run("MetricsServerReadsVMPods", func(t *testing.T) {
		k.t = t
		// metrics-server, built from its Go module, scrapes the node's
		// /metrics/resource like on any cluster; its metrics API is read
		// directly (this control plane has no aggregation layer set up).
		root, err := cluster.RepoRoot()
		require.NoError(t, err)
		b, err := exec.Command(filepath.Join(root, "hack", "build-metrics-server.sh")).Output()
		require.NoError(t, err, "hack/build-metrics-server.sh")
		port := testutil.FreePort(t)
		admin := k.c.AdminKubeconfig()
		ms := exec.Command(strings.TrimSpace(string(b)), "--kubeconfig="+admin, "--authentication-kubeconfig="+admin, "--authorization-kubeconfig="+admin,
			"--client-ca-file="+k.c.CAFile(), "--secure-port="+fmt.Sprint(port), "--bind-address=127.0.0.1", "--cert-dir="+t.TempDir(),
			"--kubelet-insecure-tls", "--kubelet-preferred-address-types=InternalIP", "--kubelet-use-node-status-port", "--metric-resolution=15s", "--kubelet-request-timeout=5s")
		msLog := &bgKubectl{done: make(chan struct{})}
		ms.Stdout, ms.Stderr = msLog, msLog
		ms.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		require.NoError(t, ms.Start())
		msLog.cmd = ms
		go func() { _ = ms.Wait(); close(msLog.done) }()
		t.Cleanup(msLog.stop)

		rc := restConfigFor(t, admin)
		tlsCfg, err := rest.TLSConfigFor(rc)
		require.NoError(t, err)
		tlsCfg.InsecureSkipVerify, tlsCfg.RootCAs = true, nil //nolint:gosec // metrics-server's self-signed serving cert
		cl := &http.Client{Transport: &http.Transport{TLSClientConfig: tlsCfg}, Timeout: 10 * time.Second}
		get := func(path string, v any) error {
			resp, err := cl.Get(fmt.Sprintf("https://127.0.0.1:%d%s", port, path))
			if err != nil {
				return err
			}
			defer resp.Body.Close()
			body, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != http.StatusOK {
				return fmt.Errorf("%s: %s: %s", path, resp.Status, body)
			}
			return json.Unmarshal(body, v)
		}
		var pm struct {
			Containers []struct {
				Name  string            `json:"name"`
				Usage map[string]string `json:"usage"`
			} `json:"containers"`
		}
		var nm struct {
			Usage map[string]string `json:"usage"`
		}
		deadline := time.Now().Add(120 * time.Second)
		for {
			err = get("/apis/metrics.k8s.io/v1beta1/namespaces/default/pods/kapi", &pm)
			if err == nil {
				err = get("/apis/metrics.k8s.io/v1beta1/nodes/"+a.name, &nm)
			}
			if err == nil {
				break
			}
			select {
			case <-msLog.done:
				t.Fatalf("metrics-server exited: %v\n%s", err, tail(msLog.output(), 30))
			default:
			}
			require.True(t, time.Now().Before(deadline), "metrics-server has no metrics for pod kapi: %v\nmetrics-server log:\n%s", err, tail(msLog.output(), 30))
			time.Sleep(2 * time.Second)
		}
		require.Len(t, pm.Containers, 1)
		assert.Equal(t, "vm", pm.Containers[0].Name)
		cpu, mem := resource.MustParse(pm.Containers[0].Usage["cpu"]), resource.MustParse(pm.Containers[0].Usage["memory"])
		assert.Greater(t, mem.Value(), int64(20<<20), "QEMU's working set")
		assert.False(t, cpu.IsZero() && mem.IsZero())
		t.Logf("metrics-server: pod kapi cpu=%s memory=%s; node cpu=%s memory=%s", cpu.String(), mem.String(), nm.Usage["cpu"], nm.Usage["memory"])
		assert.NotEmpty(t, nm.Usage["cpu"])
		assert.NotEmpty(t, nm.Usage["memory"])
	})

	t.Run("PortForwardReachesGuestHTTP", func(t *testing.T) {
		k.t = t
		l1, l2 := testutil.FreePort(t), testutil.FreePort(t)
		pf := k.start(nil, "port-forward", "pod/kapi", fmt.Sprintf("%d:8080", l1), fmt.Sprintf("%d:8080", l2))
		pf.waitFor(t, fmt.Sprintf("Forwarding from 127.0.0.1:%d", l2), 30*time.Second)
		// Both forwards, concurrently, several requests each.
		var wg sync.WaitGroup
		errs := make(chan error, 6)
		for _, port := range []int{l1, l2, l1, l2, l1, l2} {
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs <- httpExpect(fmt.Sprintf("http://127.0.0.1:%d/", port), "QK-HTTP-OK", 60*time.Second)
			}()
		}
		wg.Wait()
		close(errs)
		failed := false
		for err := range errs {
			failed = !assert.NoError(t, err) || failed
		}
		if failed {
			// kubectl exits on the first error a forwarded connection
			// reports (every later connection is then refused): its
			// output says which error that was.
			t.Logf("kubectl port-forward output:\n%s", pf.output())
		}

		// A guest port nothing listens on: the connection closes and kubectl
		// reports the guest's refusal.
		l3 := testutil.FreePort(t)
		bad := k.start(nil, "port-forward", "pod/kapi", fmt.Sprintf("%d:9999", l3))
		bad.waitFor(t, fmt.Sprintf("Forwarding from 127.0.0.1:%d", l3), 30*time.Second)
		resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/", l3))
		if err == nil {
			resp.Body.Close()
			t.Fatalf("GET through a forward to a closed guest port got %s", resp.Status)
		}
		bad.waitFor(t, "connection refused by the guest", 30*time.Second)
	})

	t.Run("AttachEchoesOneWriterManyReaders", func(t *testing.T) {
		k.t = t
		follow := k.start(nil, "logs", "-f", "kapi", "--tail=1")
		reader := k.start(nil, "attach", "kapi")
		stdin, w := osPipe(t)
		writer := k.start(stdin, "attach", "-i", "kapi")
		// Type until every attachment and logs -f saw the echo (each is set
		// up asynchronously; retrying keeps the test independent of that).
		deadline := time.Now().Add(90 * time.Second)
		for n := 0; ; n++ {
			if strings.Contains(writer.output(), "QK-ECHO: hello-attach") &&
				strings.Contains(reader.output(), "QK-ECHO: hello-attach") &&
				strings.Contains(follow.output(), "QK-ECHO: hello-attach") {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("no echo through attach;\nwriter:\n%s\nreader:\n%s\nlogs -f:\n%s", tail(writer.output(), 10), tail(reader.output(), 10), tail(follow.output(), 10))
			}
			_, err := fmt.Fprintf(w, "hello-attach-%d\n", n)
			require.NoError(t, err)
			time.Sleep(2 * time.Second)
		}
		// A second writer is refused while the first is attached.
		out, err := k.run("attach", "-i", "kapi")
		require.Error(t, err)
		assert.Contains(t, out, "one writer at a time")

		// Detach: the writer goes away; the VM keeps running and a new
		// writer may attach.
		writer.stop()
		stdin2, w2 := osPipe(t)
		again := k.start(stdin2, "attach", "-i", "kapi")
		deadline = time.Now().Add(60 * time.Second)
		for !strings.Contains(again.output(), "QK-ECHO: second-writer") {
			require.True(t, time.Now().Before(deadline), "no echo for the second writer (writer lock not released after detach?):\n%s", tail(again.output(), 20))
			_, err := w2.Write([]byte("second-writer\n"))
			require.NoError(t, err)
			time.Sleep(3 * time.Second)
		}
		again.stop()
		reader.stop()
		follow.stop()
		p := waitPod(t, c, "default", "kapi", 10*time.Second, "still running", podRunning)
		assert.Zero(t, p.Status.ContainerStatuses[0].RestartCount)
	})

	t.Run("AttachTTYRawTerminal", func(t *testing.T) {
		k.t = t
		// kubectl attach -it on a real terminal (a pty): kubectl puts it in
		// raw mode and sends keystrokes as typed (Enter is CR).
		out, master := k.startTTY("attach", "-it", "kapi")
		out.waitFor(t, "If you don't see a command prompt", 30*time.Second)
		deadline := time.Now().Add(60 * time.Second)
		for n := 0; !strings.Contains(out.output(), "QK-ECHO: hello-tty"); n++ {
			require.True(t, time.Now().Before(deadline), "no echo through attach -it:\n%s", tail(out.output(), 20))
			_, err := fmt.Fprintf(master, "hello-tty-%d\r", n)
			require.NoError(t, err)
			time.Sleep(2 * time.Second)
		}
		assert.NotContains(t, out.output(), "Unable to use a TTY")
	})

	t.Run("UnauthorizedUserIsForbidden", func(t *testing.T) {
		k.t = t
		kc, err := c.UserKubeconfig("intruder")
		require.NoError(t, err)
		for _, args := range [][]string{
			{"logs", "kapi"},
			{"attach", "kapi"},
			{"port-forward", "pod/kapi", "18080:8080"},
			{"get", "--raw", "/api/v1/nodes/" + a.name + "/proxy/stats/summary"},
		} {
			out, err := k.runAs(kc, args...)
			require.Error(t, err, "%v", args)
			assert.Contains(t, strings.ToLower(out), "forbidden", "%v: %s", args, out)
		}

		// A user who may read pods but not their log/attach/portforward
		// subresources is refused exactly those.
		ctx := context.Background()
		_, err = c.Client().RbacV1().Roles("default").Create(ctx, &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Name: "pod-reader"},
			Rules: []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get", "list"}}}}, metav1.CreateOptions{})
		require.NoError(t, err)
		_, err = c.Client().RbacV1().RoleBindings("default").Create(ctx, &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "pod-reader"},
			RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "Role", Name: "pod-reader"},
			Subjects: []rbacv1.Subject{{APIGroup: "rbac.authorization.k8s.io", Kind: "User", Name: "viewer"}}}, metav1.CreateOptions{})
		require.NoError(t, err)
		vc, err := c.UserKubeconfig("viewer")
		require.NoError(t, err)
		for deadline := time.Now().Add(30 * time.Second); ; {
			out, err := k.runAs(vc, "get", "pod", "kapi")
			if err == nil {
				break
			}
			require.True(t, time.Now().Before(deadline), "viewer cannot get the pod: %s", out)
			time.Sleep(time.Second)
		}
		for sub, args := range map[string][]string{
			"pods/log":         {"logs", "kapi"},
			"pods/attach":      {"attach", "kapi"},
			"pods/portforward": {"port-forward", "pod/kapi", "18080:8080"},
			"pods/exec":        {"exec", "kapi", "--", "true"},
		} {
			out, err := k.runAs(vc, args...)
			require.Error(t, err, "%v", args)
			assert.Contains(t, out, "forbidden", "%v: %s", args, out)
			assert.Contains(t, out, `cannot `, "%v: %s", args, out)
			assert.Contains(t, out, `resource "`+sub+`"`, "%v: %s", args, out)
		}
	})

	t.Run("PreviousAfterRestart", func(t *testing.T) {
		k.t = t
		dir := a.vmDir(string(pod.UID))
		pids := vmtest.QEMUPids(dir)
		require.Len(t, pids, 1)
		require.NoError(t, syscall.Kill(pids[0], syscall.SIGKILL))
		waitPod(t, c, "default", "kapi", 150*time.Second, "restartCount 1 and Running", func(p *corev1.Pod) bool {
			return podRunning(p) && p.Status.ContainerStatuses[0].RestartCount == 1
		})
		out := k.ok("logs", "kapi", "--previous")
		assert.Contains(t, out, vmtest.BootMarker)
		assert.Contains(t, out, "QK-ECHO: hello-attach", "the previous run's console")
		out = k.eventually(90*time.Second, vmtest.BootMarker, "logs", "kapi")
		assert.NotContains(t, out, "QK-ECHO: hello-attach", "the current run's console only")
	})

	t.Run("ProbesGateReadyAndLivenessRestarts", func(t *testing.T) {
		k.t = t
		ctx := context.Background()
		httpProbe := func(port int32) *corev1.Probe {
			return &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/", Port: intstr.FromInt32(port)}},
				PeriodSeconds: 2, TimeoutSeconds: 2, FailureThreshold: 2, SuccessThreshold: 1}
		}
		tcpProbe := func(port int32) *corev1.Probe {
			return &corev1.Probe{ProbeHandler: corev1.ProbeHandler{TCPSocket: &corev1.TCPSocketAction{Port: intstr.FromInt32(port)}},
				PeriodSeconds: 2, TimeoutSeconds: 2, FailureThreshold: 2, SuccessThreshold: 1}
		}
		good := vmPodSpec("probe-ok", a.name, refs[vmtest.VariantACPI], corev1.RestartPolicyAlways, nil)
		good.Spec.Containers[0].Ports = []corev1.ContainerPort{{Name: "http", ContainerPort: 8080}}
		good.Spec.Containers[0].ReadinessProbe = httpProbe(8080)
		good.Spec.Containers[0].LivenessProbe = tcpProbe(8080)
		// Liveness starts once the guest serves (a startup probe, the
		// kubelet's answer to slow starts), not after a fixed delay: a TCG
		// guest on a loaded host booted past a 20 s initial delay and the
		// good pod was killed once.
		good.Spec.Containers[0].StartupProbe = httpProbe(8080)
		good.Spec.Containers[0].StartupProbe.FailureThreshold = 60
		bad := vmPodSpec("probe-bad", a.name, refs[vmtest.VariantACPI], corev1.RestartPolicyAlways, nil)
		bad.Spec.Containers[0].ReadinessProbe = tcpProbe(9999)
		bad.Spec.Containers[0].LivenessProbe = httpProbe(9999)
		bad.Spec.Containers[0].LivenessProbe.InitialDelaySeconds = 15
		bad.Spec.TerminationGracePeriodSeconds = ptr.To(shortGrace)
		for _, p := range []*corev1.Pod{good, bad} {
			_, err := c.Client().CoreV1().Pods("default").Create(ctx, p, metav1.CreateOptions{})
			require.NoError(t, err)
		}
		isReady := func(p *corev1.Pod) bool {
			for _, c := range p.Status.Conditions {
				if c.Type == corev1.PodReady {
					return c.Status == corev1.ConditionTrue
				}
			}
			return false
		}
		// The VM runs before the guest serves: Running but not Ready first.
		p := waitPod(t, c, "default", "probe-ok", 120*time.Second, "Running", podRunning)
		if !isReady(p) {
			t.Logf("probe-ok Running and not yet Ready, as expected while the guest boots")
		}
		p = waitPod(t, c, "default", "probe-ok", 120*time.Second, "Ready by its httpGet probe", isReady)
		assert.True(t, p.Status.ContainerStatuses[0].Ready)

		// The closed guest port: Running, never Ready; the liveness probe
		// kills the VM and it restarts.
		p = waitPod(t, c, "default", "probe-bad", 120*time.Second, "Running", podRunning)
		assert.False(t, isReady(p))
		p = waitPod(t, c, "default", "probe-bad", 150*time.Second, "restarted by its liveness probe", func(p *corev1.Pod) bool {
			return len(p.Status.ContainerStatuses) == 1 && p.Status.ContainerStatuses[0].RestartCount >= 1
		})
		last := p.Status.ContainerStatuses[0].LastTerminationState.Terminated
		require.NotNil(t, last, "%+v", p.Status.ContainerStatuses[0])
		assert.Equal(t, int32(137), last.ExitCode)
		assert.False(t, isReady(p))
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodReady {
				assert.Equal(t, "ContainersNotReady", c.Reason)
			}
		}
		ev := k.ok("get", "events", "--field-selector", "involvedObject.name=probe-bad")
		assert.Contains(t, ev, "Readiness probe failed")
		assert.Contains(t, ev, "Liveness probe failed")
		assert.Contains(t, ev, "failed liveness probe, will be restarted")

		// The good pod stayed up and Ready all along.
		p = waitPod(t, c, "default", "probe-ok", 10*time.Second, "Ready", isReady)
		assert.Zero(t, p.Status.ContainerStatuses[0].RestartCount)
		for _, n := range []string{"probe-ok", "probe-bad"} {
			require.NoError(t, c.Client().CoreV1().Pods("default").Delete(ctx, n, metav1.DeleteOptions{}))
		}
		for _, n := range []string{"probe-ok", "probe-bad"} {
			waitPodGone(t, c, "default", n, 90*time.Second)
		}
	})

	t.Run("StartupProbeHoldsTheOthers", func(t *testing.T) {
		k.t = t
		ctx := context.Background()
		ok := vmPodSpec("startup-ok", a.name, refs[vmtest.VariantACPI], corev1.RestartPolicyAlways, nil)
		ok.Spec.Containers[0].StartupProbe = &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/", Port: intstr.FromInt32(8080)}},
			PeriodSeconds: 2, TimeoutSeconds: 2, FailureThreshold: 60}
		bad := vmPodSpec("startup-bad", a.name, refs[vmtest.VariantACPI], corev1.RestartPolicyAlways, nil)
		bad.Spec.Containers[0].StartupProbe = &corev1.Probe{ProbeHandler: corev1.ProbeHandler{TCPSocket: &corev1.TCPSocketAction{Port: intstr.FromInt32(9999)}},
			InitialDelaySeconds: 5, PeriodSeconds: 2, TimeoutSeconds: 2, FailureThreshold: 3}
		// Would kill at once if it ran before the startup probe succeeded.
		bad.Spec.Containers[0].LivenessProbe = &corev1.Probe{ProbeHandler: corev1.ProbeHandler{TCPSocket: &corev1.TCPSocketAction{Port: intstr.FromInt32(9998)}},
			PeriodSeconds: 1, TimeoutSeconds: 1, FailureThreshold: 1}
		bad.Spec.TerminationGracePeriodSeconds = ptr.To(shortGrace)
		for _, p := range []*corev1.Pod{ok, bad} {
			_, err := c.Client().CoreV1().Pods("default").Create(ctx, p, metav1.CreateOptions{})
			require.NoError(t, err)
		}
		p := waitPod(t, c, "default", "startup-ok", 120*time.Second, "Running", podRunning)
		if s := p.Status.ContainerStatuses[0].Started; s != nil && !*s {
			t.Logf("startup-ok Running, not started yet, as expected while the guest boots")
		}
		p = waitPod(t, c, "default", "startup-ok", 120*time.Second, "started and Ready", func(p *corev1.Pod) bool {
			cs := p.Status.ContainerStatuses
			return len(cs) == 1 && cs[0].Started != nil && *cs[0].Started && cs[0].Ready
		})
		assert.Zero(t, p.Status.ContainerStatuses[0].RestartCount)

		p = waitPod(t, c, "default", "startup-bad", 150*time.Second, "restarted by its startup probe", func(p *corev1.Pod) bool {
			return len(p.Status.ContainerStatuses) == 1 && p.Status.ContainerStatuses[0].RestartCount >= 1
		})
		require.NotNil(t, p.Status.ContainerStatuses[0].LastTerminationState.Terminated)
		assert.Equal(t, int32(137), p.Status.ContainerStatuses[0].LastTerminationState.Terminated.ExitCode)
		ev := k.ok("get", "events", "--field-selector", "involvedObject.name=startup-bad")
		assert.Contains(t, ev, "Startup probe failed")
		assert.Contains(t, ev, "failed startup probe, will be restarted")
		assert.NotContains(t, ev, "Liveness probe failed", "liveness waits for the startup probe")
		for _, n := range []string{"startup-ok", "startup-bad"} {
			require.NoError(t, c.Client().CoreV1().Pods("default").Delete(ctx, n, metav1.DeleteOptions{}))
		}
		for _, n := range []string{"startup-ok", "startup-bad"} {
			waitPodGone(t, c, "default", n, 90*time.Second)
		}
	})

	t.Run("GuestConfigDisks", func(t *testing.T) {
		k.t = t
		ctx := context.Background()
		q := resource.MustParse("16Mi")
		_, err := c.Client().CoreV1().ConfigMaps("default").Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "app"},
			Data: map[string]string{"a.conf": "x=1\n"}}, metav1.CreateOptions{})
		require.NoError(t, err)
		_, err = c.Client().CoreV1().ConfigMaps("default").Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "seed"},
			Data: map[string]string{"user-data": "#cloud-config\n"}}, metav1.CreateOptions{})
		require.NoError(t, err)
		p := vmPodSpec("cfg", a.name, refs[vmtest.VariantACPI], corev1.RestartPolicyAlways, nil)
		p.Spec.Volumes = []corev1.Volume{
			{Name: "creds", VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{SecretName: "creds"}}},
			{Name: "app", VolumeSource: corev1.VolumeSource{ConfigMap: &corev1.ConfigMapVolumeSource{LocalObjectReference: corev1.LocalObjectReference{Name: "app"}}}},
			{Name: "cloud-init", VolumeSource: corev1.VolumeSource{ConfigMap: &corev1.ConfigMapVolumeSource{LocalObjectReference: corev1.LocalObjectReference{Name: "seed"}}}},
			{Name: "scratch", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{SizeLimit: &q}}},
		}
		p.Spec.Containers[0].Env = []corev1.EnvVar{{Name: "A", Value: "1"},
			{Name: "TOKEN", ValueFrom: &corev1.EnvVarSource{SecretKeyRef: &corev1.SecretKeySelector{LocalObjectReference: corev1.LocalObjectReference{Name: "creds"}, Key: "token"}}}}
		_, err = c.Client().CoreV1().Pods("default").Create(ctx, p, metav1.CreateOptions{})
		require.NoError(t, err)
		// The secret is missing: the pod waits, as on a kubelet.
		got := waitPod(t, c, "default", "cfg", 120*time.Second, "CreateContainerConfigError", func(p *corev1.Pod) bool {
			cs := p.Status.ContainerStatuses
			return len(cs) == 1 && cs[0].State.Waiting != nil && cs[0].State.Waiting.Reason == "CreateContainerConfigError"
		})
		assert.Contains(t, got.Status.ContainerStatuses[0].State.Waiting.Message, `secret "creds" not found`)
		assert.Equal(t, corev1.PodPending, got.Status.Phase)

		_, err = c.Client().CoreV1().Secrets("default").Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "creds"},
			Data: map[string][]byte{"token": []byte("s3cret")}}, metav1.CreateOptions{})
		require.NoError(t, err)
		waitPod(t, c, "default", "cfg", 150*time.Second, "Running", podRunning)
		// The guest mounts each FAT disk and prints the md5 of every file.
		md5 := func(s string) string { return fmt.Sprintf("%x", md5sum([]byte(s))) }
		out := k.eventually(90*time.Second, vmtest.BootMarker, "logs", "cfg")
		for _, want := range []string{
			"QK-CONFIG creds token " + md5("s3cret"),
			"QK-CONFIG app a.conf " + md5("x=1\n"),
			"QK-CONFIG cloud-init user-data " + md5("#cloud-config\n"),
			"QK-CONFIG cloud-init meta-data " + md5("instance-id: "+string(got.UID)+"\nlocal-hostname: cfg\n"),
			"QK-CONFIG env env " + md5("A='1'\nTOKEN='s3cret'\n"),
			"QK-DISK scratch 32768 sectors",
		} {
			assert.Contains(t, out, want)
		}
		require.NoError(t, c.Client().CoreV1().Pods("default").Delete(ctx, "cfg", metav1.DeleteOptions{}))
		waitPodGone(t, c, "default", "cfg", 90*time.Second)
	})

	t.Run("LogsAfterQemuKubeletRestart", func(t *testing.T) {
		k.t = t
		before := k.ok("logs", "kapi")
		_ = a.kill(syscall.SIGKILL)
		a.start()
		waitNode(t, c, a.name, 90*time.Second, "Ready=True", readyIs(corev1.ConditionTrue))
		out := k.eventually(60*time.Second, vmtest.BootMarker, "logs", "kapi")
		assert.True(t, strings.HasPrefix(out, strings.TrimRight(before, "\n")), "the console kept across the restart")
		out = k.ok("logs", "kapi", "--previous")
		assert.Contains(t, out, vmtest.BootMarker)
	})
}

// kubectlEnv runs the real kubectl against the test cluster.
type kubectlEnv struct {
	t *testing.T
	c *cluster.Cluster
}

func (k *kubectlEnv) run(args ...string) (string, error) {
	return k.runAs(k.c.AdminKubeconfig(), args...)
}

func (k *kubectlEnv) runAs(kubeconfig string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, k.c.KubectlPath(), append([]string{"--kubeconfig=" + kubeconfig}, args...)...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	out, err := cmd.CombinedOutput()
	return string(out), err
}

func (k *kubectlEnv) ok(args ...string) string {
	k.t.Helper()
	out, err := k.run(args...)
	require.NoError(k.t, err, "kubectl %s: %s", strings.Join(args, " "), out)
	return out
}

// eventually runs kubectl until its output contains want.
func (k *kubectlEnv) eventually(timeout time.Duration, want string, args ...string) string {
	k.t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		out, err := k.run(args...)
		if err == nil && strings.Contains(out, want) {
			return out
		}
		if time.Now().After(deadline) {
			k.t.Fatalf("kubectl %s: no %q within %s (err %v):\n%s", strings.Join(args, " "), want, timeout, err, tail(out, 20))
		}
		time.Sleep(time.Second)
	}
}

// bgKubectl is a long-running kubectl (logs -f, attach, port-forward)
// whose combined output is collected; killed (process group) at cleanup.
type bgKubectl struct {
	cmd  *exec.Cmd
	mu   sync.Mutex
	out  bytes.Buffer
	done chan struct{}
}

func (b *bgKubectl) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.out.Write(p)
}

func (b *bgKubectl) output() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.out.String()
}

func (b *bgKubectl) stop() {
	_ = syscall.Kill(-b.cmd.Process.Pid, syscall.SIGKILL)
	<-b.done
}

func (b *bgKubectl) waitFor(t *testing.T, want string, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !strings.Contains(b.output(), want) {
		if time.Now().After(deadline) {
			t.Fatalf("kubectl %s: no %q within %s:\n%s", strings.Join(b.cmd.Args[2:], " "), want, timeout, tail(b.output(), 20))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func (k *kubectlEnv) start(stdin io.Reader, args ...string) *bgKubectl {
	k.t.Helper()
	b := &bgKubectl{done: make(chan struct{})}
	b.cmd = exec.Command(k.c.KubectlPath(), append([]string{"--kubeconfig=" + k.c.AdminKubeconfig()}, args...)...)
	b.cmd.Stdin = stdin
	b.cmd.Stdout, b.cmd.Stderr = b, b
	b.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	require.NoError(k.t, b.cmd.Start())
	if f, ok := stdin.(*os.File); ok {
		f.Close() // the child has its copy
	}
	go func() { _ = b.cmd.Wait(); close(b.done) }()
	k.t.Cleanup(b.stop)
	return b
}

// startTTY runs kubectl with args on a real terminal (a pty, as its
// controlling terminal in a session of its own): kubectl keeps -t only on
// one. It returns the running kubectl (killed with its session at cleanup)
// and the terminal's master side to type into.
func (k *kubectlEnv) startTTY(args ...string) (*bgKubectl, *os.File) {
	k.t.Helper()
	t := k.t
	master, slave := openPTY(t)
	cmd := exec.Command(k.c.KubectlPath(), append([]string{"--kubeconfig=" + k.c.AdminKubeconfig()}, args...)...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = slave, slave, slave
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0}
	require.NoError(t, cmd.Start())
	slave.Close()
	b := &bgKubectl{cmd: cmd, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(b.done) }()
	t.Cleanup(func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-b.done
	})
	go func() { _, _ = io.Copy(b, master) }()
	return b, master
}

// osPipe is a kernel pipe: writes do not block on a reader that is gone
// (unlike io.Pipe), so a test typing into a dead kubectl fails instead of
// hanging. The write end is closed at cleanup.
func osPipe(t *testing.T) (*os.File, *os.File) {
	t.Helper()
	r, w, err := os.Pipe()
	require.NoError(t, err)
	t.Cleanup(func() { w.Close(); r.Close() })
	return r, w
}

func md5sum(b []byte) [16]byte { return md5.Sum(b) } //nolint:gosec // matches the guest's md5sum

// openPTY opens a pseudo-terminal pair (closed at cleanup).
func openPTY(t *testing.T) (*os.File, *os.File) {
	t.Helper()
	m, err := os.OpenFile("/dev/ptmx", os.O_RDWR|syscall.O_NOCTTY, 0)
	require.NoError(t, err)
	t.Cleanup(func() { m.Close() })
	require.NoError(t, unix.IoctlSetPointerInt(int(m.Fd()), unix.TIOCSPTLCK, 0))
	n, err := unix.IoctlGetInt(int(m.Fd()), unix.TIOCGPTN)
	require.NoError(t, err)
	sl, err := os.OpenFile(fmt.Sprintf("/dev/pts/%d", n), os.O_RDWR|syscall.O_NOCTTY, 0)
	require.NoError(t, err)
	t.Cleanup(func() { sl.Close() })
	return m, sl
}

// httpExpect GETs url until the body contains want.
func httpExpect(url, want string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	cl := &http.Client{Timeout: 20 * time.Second}
	var last string
	for time.Now().Before(deadline) {
		resp, err := cl.Get(url)
		if err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if strings.Contains(string(b), want) {
				return nil
			}
			last = resp.Status + " " + string(b)
		} else {
			last = err.Error()
		}
		time.Sleep(time.Second)
	}
	return fmt.Errorf("GET %s: no %q within %s (last: %s)", url, want, timeout, last)
}
