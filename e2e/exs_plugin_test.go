package e2e

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/oci/ocitest"
)

// exsPlugin runs the kubectl plugin kubectl-exs, built by the test, as
// `kubectl exs` (real kubectl, the plugin found on PATH).
type exsPlugin struct {
	kubectl, path, kubeconfig, ns string
}

func (e *exsEnv) buildExsPlugin(t *testing.T) *exsPlugin {
	t.Helper()
	dir := t.TempDir()
	goBuild(t, ocitest.RepoRoot(t), dir, "./cmd/kubectl-exs")
	return &exsPlugin{kubectl: filepath.Join(e.c.BinDir(), "kubectl"), path: dir + ":" + e.c.BinDir() + ":" + os.Getenv("PATH"),
		kubeconfig: e.c.AdminKubeconfig(), ns: e.ns}
}

func (x *exsPlugin) cmd(ctx context.Context, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, x.kubectl, append([]string{"exs", "-n", x.ns}, args...)...)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+x.kubeconfig, "PATH="+x.path)
	return cmd
}

// run runs `kubectl exs args...` to its end: stdout, stderr and error.
func (x *exsPlugin) run(args ...string) (string, string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := x.cmd(ctx, args...)
	var o, e bytes.Buffer
	cmd.Stdout, cmd.Stderr = &o, &e
	err := cmd.Run()
	return o.String(), e.String(), err
}

// leaseResult is what one `kubectl exs lease -o name` client ended with.
type leaseResult struct {
	holder, pod, stderr string
	err                 error
	at                  time.Time
}

// testLeasePlugin: `kubectl exs lease` by 4 concurrent clients on a set of
// 2 free targets (maxReplicas 2, recyclePolicy Reuse): exactly 2 win at
// once, 2 wait (watching) and each gets a target when one is released by
// `kubectl exs release`; `lease` without --wait fails with the counts;
// `list` shows the holders. Then, with Replace, `lease --for 20s`: the
// lease holds for its duration, then the controller deletes the pod
// (LeaseExpired) and a fresh VM boots in its place.
func (e *exsEnv) testLeasePlugin(t *testing.T) {
	ctx := context.Background()
	const name = "plug"
	x := e.buildExsPlugin(t)
	set := e.newSet(name, e.image, 2, 0)
	set.Spec.MaxReplicas = ptr.To[int32](2)
	set.Spec.RecyclePolicy = v1alpha1.RecyclePolicyReuse
	e.createSet(t, set)
	_, pods := e.waitCounts(t, name, counts{2, 2, 2, 2, 0}, 2*vmBoot)
	targets := podNames(pods)

	// 1. Four clients at once.
	results := make(chan leaseResult, 4)
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	for i := range 4 {
		holder := fmt.Sprintf("ci-%d", i+1)
		cmd := x.cmd(cctx, "lease", name, "--wait", "--timeout", "6m", "--holder", holder, "-o", "name")
		var o, se bytes.Buffer
		cmd.Stdout, cmd.Stderr = &o, &se
		require.NoError(t, cmd.Start())
		go func() {
			err := cmd.Wait()
			results <- leaseResult{holder: holder, pod: strings.TrimPrefix(strings.TrimSpace(o.String()), "pod/"), stderr: se.String(), err: err, at: time.Now()}
		}()
	}
	next := func(within time.Duration) leaseResult {
		t.Helper()
		select {
		case r := <-results:
			require.NoError(t, r.err, "client %s: %s", r.holder, r.stderr)
			return r
		case <-time.After(within):
			t.Fatalf("no client got a target within %s", within)
			return leaseResult{}
		}
	}
	stillWaiting := func(n int) {
		t.Helper()
		select {
		case r := <-results:
			t.Fatalf("client %s ended (pod %q, err %v) while %d should still wait: %s", r.holder, r.pod, r.err, n, r.stderr)
		case <-time.After(3 * time.Second): // time for a wrong second claim to land
		}
	}
	w1, w2 := next(time.Minute), next(time.Minute)
	stillWaiting(2)
	assert.ElementsMatch(t, targets, []string{w1.pod, w2.pod}, "the two winners hold the two targets")
	holders := map[string]string{}
	_, pods = e.waitCounts(t, name, counts{2, 2, 2, 0, 2}, 30*time.Second)
	for _, p := range pods {
		holders[p.Name] = p.Labels[v1alpha1.LeaseLabel]
		assert.Equal(t, "true", p.Labels[v1alpha1.UsedLabel])
		assert.NotEmpty(t, p.Annotations[v1alpha1.LeasedAtAnnotation])
		assert.NotContains(t, p.Annotations, v1alpha1.LeaseExpiresAnnotation, "no --for: until released")
	}
	assert.Equal(t, map[string]string{w1.pod: w1.holder, w2.pod: w2.holder}, holders, "each pod labelled by the client that got it")

	// No --wait: a clear error with the counts; nothing changes.
	_, stderr, err := x.run("lease", name, "--holder", "impatient")
	require.Error(t, err)
	assert.Contains(t, stderr, "no free target in exporterset default/plug (2 pods: 2 leased); --wait waits for one")

	out, stderr, err := x.run("list", name)
	require.NoError(t, err, stderr)
	for _, w := range []leaseResult{w1, w2} {
		assert.Regexp(t, fmt.Sprintf(`(?m)^plug\s+%s\s+leased\s+%s\s`, w.pod, w.holder), out)
	}
	assert.Regexp(t, `(?m)^plug\s+standalone\s+Reuse\s+2\s+0\s+2\s+0$`, out)

	// Releasing someone else's pod needs --force.
	_, stderr, err = x.run("release", w1.pod, "--holder", w2.holder)
	require.Error(t, err)
	assert.Contains(t, stderr, fmt.Sprintf("leased by %q, not by %q", w1.holder, w2.holder))

	// 2. Release one: exactly one waiter gets it (Reuse: the same pod,
	// back in the buffer once the controller cleared its used mark).
	out, stderr, err = x.run("release", w1.pod, "--holder", w1.holder)
	require.NoError(t, err, stderr)
	assert.Contains(t, out, "returns it to the warm buffer")
	w3 := next(time.Minute)
	assert.Equal(t, w1.pod, w3.pod, "the released target went to a waiter")
	assert.Contains(t, w3.stderr, "Waiting for a free target of exporterset default/plug (2 pods: 2 leased)")
	stillWaiting(1)

	// 3. Release the other: the last waiter gets it.
	_, stderr, err = x.run("release", "pod/"+w2.pod, "--holder", w2.holder)
	require.NoError(t, err, stderr)
	w4 := next(time.Minute)
	assert.Equal(t, w2.pod, w4.pod)
	_, pods = e.waitCounts(t, name, counts{2, 2, 2, 0, 2}, 30*time.Second)
	for _, p := range pods {
		want := map[string]string{w3.pod: w3.holder, w4.pod: w4.holder}[p.Name]
		assert.Equal(t, want, p.Labels[v1alpha1.LeaseLabel], "pod %s", p.Name)
	}
	for _, w := range []leaseResult{w3, w4} {
		_, stderr, err = x.run("release", w.pod, "--holder", w.holder)
		require.NoError(t, err, stderr)
	}
	_, pods = e.waitCounts(t, name, counts{2, 2, 2, 2, 0}, time.Minute)

	// 4. --for 20s with Replace: the lease holds, then expires and the
	// controller deletes the pod; a fresh VM takes its place.
	patch := client.RawPatch(types.MergePatchType, []byte(`{"spec":{"recyclePolicy":"Replace"}}`))
	require.NoError(t, e.cl.Patch(ctx, &v1alpha1.ExporterSet{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: e.ns}}, patch))
	claimed := time.Now()
	out, stderr, err = x.run("lease", name, "--for", "20s", "--holder", "ci-exp")
	require.NoError(t, err, stderr)
	assert.Regexp(t, `Leased pod plug-\S+ of exporterset plug as ci-exp until \S+Z \(in 1\ds\)\.`, out)
	assert.Contains(t, out, "kubectl -n default port-forward pod/")
	var exp corev1.Pod
	for _, p := range pods {
		if strings.Contains(out, "Leased pod "+p.Name+" ") {
			exp = p
		}
	}
	require.NotEmpty(t, exp.UID, "the lease names one of %v:\n%s", podNames(pods), out)
	got, err := e.c.Client().CoreV1().Pods(e.ns).Get(ctx, exp.Name, metav1.GetOptions{})
	require.NoError(t, err)
	expires, err := time.Parse(time.RFC3339, got.Annotations[v1alpha1.LeaseExpiresAnnotation])
	require.NoError(t, err)
	assert.WithinDuration(t, claimed.Add(20*time.Second), expires, 3*time.Second)

	// Halfway, the lease still holds.
	time.Sleep(time.Until(claimed.Add(10 * time.Second)))
	got, err = e.c.Client().CoreV1().Pods(e.ns).Get(ctx, exp.Name, metav1.GetOptions{})
	require.NoError(t, err, "the pod is there before its lease expires")
	assert.Nil(t, got.DeletionTimestamp)
	assert.Equal(t, "ci-exp", got.Labels[v1alpha1.LeaseLabel])

	e.waitVMGone(t, exp, 20*time.Second+90*time.Second)
	_, pods = e.waitCounts(t, name, counts{2, 2, 2, 2, 0}, vmBoot)
	assert.NotContains(t, podNames(pods), exp.Name)
	assert.True(t, slices.ContainsFunc(pods, func(p corev1.Pod) bool { return e.booted(p) && p.Name != exp.Name }))
	out, err = e.c.Kubectl(ctx, "describe", "exs", name)
	require.NoError(t, err)
	assert.Contains(t, out, "Deleted pod: "+exp.Name+" (LeaseExpired)")
}
