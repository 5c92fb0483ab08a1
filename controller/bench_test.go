package controller

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/internal/pinned"
)

// Both controllers talk to the apiserver with the same client-side limits,
// high enough not to be the bottleneck (kube-controller-manager's defaults,
// 20/30, would measure its rate limiter).
const benchQPS, benchBurst = 1000, 2000

// startKCM runs the real kube-controller-manager (replicaset controller
// only) against the test apiserver until the benchmark ends.
func startKCM(b *testing.B) {
	b.Helper()
	cmd := exec.Command(filepath.Join(filepath.Dir(env.kubectl), "kube-controller-manager"),
		"--kubeconfig="+env.kubeconfig, "--controllers=replicaset-controller,deployment-controller", "--leader-elect=false",
		"--secure-port=0", fmt.Sprintf("--kube-api-qps=%d", benchQPS), fmt.Sprintf("--kube-api-burst=%d", benchBurst),
		"--concurrent-replicaset-syncs=5", "-v=0")
	logf, err := os.CreateTemp("", "kcm-*.log")
	if err != nil {
		b.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	// Its own group, killed in cleanup; and killed with the test binary if
	// that dies first.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := pinned.Start(cmd); err != nil {
		b.Fatalf("start kube-controller-manager: %v", err)
	}
	b.Cleanup(func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		_ = cmd.Wait()
		logf.Close()
		os.Remove(logf.Name())
	})
}

// warmUpKCM waits until kube-controller-manager reconciles ReplicaSets (its
// informers synced), so that its start-up is not measured.
func warmUpKCM(b *testing.B, cs kubernetes.Interface, tmpl corev1.PodTemplateSpec) {
	b.Helper()
	ns := benchNamespace(b, cs)
	timeToPods(b, cs, ns, tmpl.Labels["app"], 1, func() error {
		_, err := cs.AppsV1().ReplicaSets(ns).Create(context.Background(), &appsv1.ReplicaSet{
			ObjectMeta: metav1.ObjectMeta{Name: "warmup"},
			Spec: appsv1.ReplicaSetSpec{Replicas: ptr.To[int32](1),
				Selector: &metav1.LabelSelector{MatchLabels: tmpl.Labels}, Template: tmpl},
		}, metav1.CreateOptions{})
		return err
	})
}

// timeToPods starts a watch, calls create, and returns the time until n pods
// with label app=app have been added in ns.
func timeToPods(b *testing.B, cs kubernetes.Interface, ns, app string, n int, create func() error) time.Duration {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	w, err := cs.CoreV1().Pods(ns).Watch(ctx, metav1.ListOptions{LabelSelector: "app=" + app})
	if err != nil {
		b.Fatalf("watch pods: %v", err)
	}
	defer w.Stop()
	start := time.Now()
	if err := create(); err != nil {
		b.Fatalf("create %s: %v", app, err)
	}
	seen := 0
	var first time.Duration
	defer func() { b.Logf("%s: first pod after %s, all %d after %s", app, first, n, time.Since(start)) }()
	for seen < n {
		select {
		case ev, ok := <-w.ResultChan():
			if !ok {
				b.Fatalf("watch of %s pods closed after %d", app, seen)
			}
			if ev.Type == watch.Added {
				if seen == 0 {
					first = time.Since(start)
				}
				seen++
			}
		case <-ctx.Done():
			b.Fatalf("%s: only %d of %d pods created", app, seen, n)
		}
	}
	return time.Since(start)
}

func benchNamespace(b *testing.B, cs kubernetes.Interface) string {
	b.Helper()
	ns, err := cs.CoreV1().Namespaces().Create(context.Background(),
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "bench-"}}, metav1.CreateOptions{})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		_ = cs.CoreV1().Pods(ns.Name).DeleteCollection(context.Background(), metav1.DeleteOptions{}, metav1.ListOptions{})
		_ = cs.CoreV1().Namespaces().Delete(context.Background(), ns.Name, metav1.DeleteOptions{})
	})
	return ns.Name
}

// BenchmarkCreate100 measures the time from creating an ExporterSet of 100
// replicas until its 100 pods exist, against the baseline of a ReplicaSet of
// 100 reconciled by the real kube-controller-manager in the same apiserver
// (and a Deployment of 100, which adds the deployment controller's step),
// both with the same client QPS/burst (kube-controller-manager speaks
// protobuf, the ExporterSet controller JSON: controller-runtime's status
// client cannot fall back to JSON for CRDs when protobuf is configured). No scheduler runs: the pods stay
// Pending and unbound, so only the controllers and the apiserver are
// measured. x-of-baseline = ReplicaSet time / ExporterSet time (>= 1 means
// the ExporterSet is at least as fast); x-of-deployment likewise.
func BenchmarkCreate100(b *testing.B) {
	const n = 100
	startKCM(b)
	cfg := rest.CopyConfig(env.cfg)
	cfg.QPS, cfg.Burst = benchQPS, benchBurst
	cs, err := kubernetes.NewForConfig(env.cfg)
	if err != nil {
		b.Fatal(err)
	}
	tmpl := func(app string) corev1.PodTemplateSpec {
		return corev1.PodTemplateSpec{
			ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"app": app}},
			Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "vm", Image: "registry.invalid/os:1"}}},
		}
	}
	warmUpKCM(b, cs, tmpl("warmup"))
	var rsTotal, depTotal, exsTotal time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		rsNS, depNS, exsNS := benchNamespace(b, cs), benchNamespace(b, cs), benchNamespace(b, cs)
		mgr, err := ctrl.NewManager(cfg, ctrl.Options{
			Scheme: env.scheme, Metrics: metricsserver.Options{BindAddress: "0"}, HealthProbeBindAddress: "0",
			Cache:      cache.Options{DefaultNamespaces: map[string]cache.Config{exsNS: {}}},
			Controller: ctrlConfigUnique(),
		})
		if err != nil {
			b.Fatal(err)
		}
		m, _ := NewMetrics(prometheus.NewRegistry())
		if err := NewReconciler(mgr.GetClient(), mgr.GetEventRecorder("exporterset-controller"), m).SetupWithManager(mgr, 4); err != nil {
			b.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- mgr.Start(ctx) }()
		// Warm up: the controller has started, synced and reconciled a set.
		timeToPods(b, cs, exsNS, "exs-warmup", 1, func() error {
			return env.client.Create(context.Background(), &v1alpha1.ExporterSet{
				ObjectMeta: metav1.ObjectMeta{Namespace: exsNS, Name: "warmup"},
				Spec: v1alpha1.ExporterSetSpec{Replicas: ptr.To[int32](1),
					Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "exs-warmup"}}, Template: tmpl("exs-warmup")},
			})
		})
		b.StartTimer()

		rs := func() {
			rsTotal += timeToPods(b, cs, rsNS, "rs", n, func() error {
				_, err := cs.AppsV1().ReplicaSets(rsNS).Create(context.Background(), &appsv1.ReplicaSet{
					ObjectMeta: metav1.ObjectMeta{Name: "rs"},
					Spec: appsv1.ReplicaSetSpec{Replicas: ptr.To[int32](n),
						Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "rs"}}, Template: tmpl("rs")},
				}, metav1.CreateOptions{})
				return err
			})
		}
		dep := func() {
			depTotal += timeToPods(b, cs, depNS, "dep", n, func() error {
				_, err := cs.AppsV1().Deployments(depNS).Create(context.Background(), &appsv1.Deployment{
					ObjectMeta: metav1.ObjectMeta{Name: "dep"},
					Spec: appsv1.DeploymentSpec{Replicas: ptr.To[int32](n),
						Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "dep"}}, Template: tmpl("dep")},
				}, metav1.CreateOptions{})
				return err
			})
		}
		exs := func() {
			exsTotal += timeToPods(b, cs, exsNS, "exs", n, func() error {
				return env.client.Create(context.Background(), &v1alpha1.ExporterSet{
					ObjectMeta: metav1.ObjectMeta{Namespace: exsNS, Name: "exs"},
					Spec: v1alpha1.ExporterSetSpec{Replicas: ptr.To[int32](n),
						Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "exs"}}, Template: tmpl("exs")},
				})
			})
		}
		if i%2 == 0 { // alternate the order so neither side always runs on a warmer apiserver
			rs()
			dep()
			exs()
		} else {
			exs()
			dep()
			rs()
		}

		b.StopTimer()
		cancel()
		if err := <-done; err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
	b.StopTimer()
	rsMS := float64(rsTotal.Milliseconds()) / float64(b.N)
	exsMS := float64(exsTotal.Milliseconds()) / float64(b.N)
	depMS := float64(depTotal.Milliseconds()) / float64(b.N)
	b.ReportMetric(rsMS, "replicaset-ms/op")
	b.ReportMetric(depMS, "deployment-ms/op")
	b.ReportMetric(exsMS, "exporterset-ms/op")
	b.ReportMetric(rsTotal.Seconds()/exsTotal.Seconds(), "x-of-baseline")
	b.ReportMetric(depTotal.Seconds()/exsTotal.Seconds(), "x-of-deployment")
}
