package cluster

import (
	"context"
	corev1 "k8s.io/api/core/v1"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
)

// TestClusterLifecycle starts a real control plane, uses it as admin and as
// an unprivileged user, and checks that Stop leaves no component running.
func TestClusterLifecycle(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	c, err := Start(ctx, Options{Logf: t.Logf})
	if err != nil {
		t.Fatal(err)
	}
	stopped := false
	defer func() {
		if !stopped {
			c.DumpLogs(t.Logf, 30)
			c.Stop()
		}
	}()

	// kubectl built from source must talk to the apiserver (it refuses an
	// unstamped v0.0.0 server).
	out, err := c.Kubectl(ctx, "version", "-o", "json")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out, `"gitVersion": "v1.35.4"`) {
		t.Fatalf("server/client version not stamped v1.35.4:\n%s", out)
	}

	// The controller-manager is really running: it creates the default
	// ServiceAccount in a new namespace.
	ns, err := c.Client().CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "cluster-test-"}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := pollUntil(ctx, func() bool {
		_, err := c.Client().CoreV1().ServiceAccounts(ns.Name).Get(ctx, "default", metav1.GetOptions{})
		return err == nil
	}); err != nil {
		t.Fatalf("kube-controller-manager did not create the default ServiceAccount: %v", err)
	}

	// An authenticated user without RBAC is forbidden.
	kc, err := c.UserKubeconfig("nobody")
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", kc)
	if err != nil {
		t.Fatal(err)
	}
	nobody := kubernetes.NewForConfigOrDie(cfg)
	if _, err := nobody.CoreV1().Pods("default").List(ctx, metav1.ListOptions{}); !apierrors.IsForbidden(err) {
		t.Fatalf("user without RBAC listing pods: want Forbidden, got %v", err)
	}

	var pids []int
	for _, p := range c.procs {
		pids = append(pids, p.cmd.Process.Pid)
	}
	if len(pids) != 4 {
		t.Fatalf("want 4 component processes, got %d", len(pids))
	}
	dir := c.Dir()
	c.Stop()
	stopped = true
	for _, pid := range pids {
		if err := syscall.Kill(pid, 0); err == nil {
			t.Errorf("process %d still alive after Stop", pid)
		}
	}
	if _, err := os.Stat(dir); err == nil {
		t.Errorf("state dir %s left behind", dir)
	}
}

func pollUntil(ctx context.Context, f func() bool) error {
	for !f() {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
	return nil
}
