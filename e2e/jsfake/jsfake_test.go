package jsfake

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/klog/v2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	jsv1 "github.com/qemu-kubelet/qemu-kubelet/api/jumpstarter/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/jstest"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/pb"
)

// apiEnv is a real apiserver (etcd and kube-apiserver from envtest) with
// Jumpstarter's CRDs and the project's own.
type apiEnv struct {
	cfg    *rest.Config
	client client.Client
	scheme *runtime.Scheme
}

// env is the apiserver of this package's tests, with the Jumpstarter CRDs
// generated from the project's types (testutil.JumpstarterCRDs); zero
// under -short. bin is the control plane's bin dir.
var (
	env apiEnv
	bin string
)

func TestMain(m *testing.M) {
	flag.Parse()
	os.Exit(run(m))
}

func run(m *testing.M) int {
	// Quiet: client-go logs through klog (e.g. events still queued when a
	// test's manager stops); the controller through controller-runtime.
	klog.SetLogger(logr.Discard())
	ctrl.SetLogger(logr.Discard())
	if testing.Short() {
		return m.Run()
	}
	root, err := testutil.RepoRoot()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	bin = os.Getenv("KUBEBUILDER_ASSETS")
	if bin == "" {
		out, err := exec.Command(filepath.Join(root, "hack", "build-control-plane.sh")).Output()
		if err != nil {
			fmt.Fprintln(os.Stderr, "hack/build-control-plane.sh:", err)
			return 1
		}
		lines := strings.Split(strings.TrimSpace(string(out)), "\n")
		bin = lines[len(lines)-1]
	}
	e, stop, err := startAPI(testutil.JumpstarterCRDs(root), filepath.Join(root, "config", "crd"))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer stop()
	defer testutil.GuardCleanup("jsfake tests", stop)()
	env = *e
	return m.Run()
}

// startAPI starts an apiserver (control plane from bin) with the CRDs of
// crdDirs installed.
func startAPI(crdDirs ...string) (*apiEnv, func(), error) {
	te := &envtest.Environment{BinaryAssetsDirectory: bin, ErrorIfCRDPathMissing: true, CRDDirectoryPaths: crdDirs}
	cfg, err := te.Start()
	if err != nil {
		_ = te.Stop() // Start leaves etcd and the API server running when the CRD install fails
		return nil, nil, fmt.Errorf("start envtest with the CRDs of %v: %w", crdDirs, err)
	}
	stop := func() { _ = te.Stop() }
	e := &apiEnv{cfg: cfg, scheme: runtime.NewScheme()}
	if err := errors.Join(clientgoscheme.AddToScheme(e.scheme), jsv1.AddToScheme(e.scheme), v1alpha1.AddToScheme(e.scheme)); err != nil {
		stop()
		return nil, nil, err
	}
	if e.client, err = client.New(cfg, client.Options{Scheme: e.scheme}); err != nil {
		stop()
		return nil, nil, err
	}
	return e, stop, nil
}

// namespace makes a namespace for one test.
func (e *apiEnv) namespace(t testing.TB) string {
	t.Helper()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "jsfake-"}}
	require.NoError(t, e.client.Create(context.Background(), ns))
	return ns.Name
}

func eventually(t testing.TB, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	last := ""
	for time.Now().Before(deadline) {
		ok, s := cond()
		if ok {
			return
		}
		last = s
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("timed out waiting for %s; last: %s", what, last)
}

// goOnline plays an exporter at the protocol level: Register, an open
// Status stream (Online) and ReportStatus AVAILABLE. stop closes it.
func goOnline(ctx context.Context, endpoint, token, ns, name string) (stop func(), err error) {
	conn, err := grpc.NewClient(endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	ectx := metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token, "jumpstarter-kind", "Exporter",
		"jumpstarter-namespace", ns, "jumpstarter-name", name)
	cs := pb.NewControllerServiceClient(conn)
	sctx, scancel := context.WithCancel(ectx)
	stop = func() { scancel(); conn.Close() }
	if _, err := cs.Register(ectx, &pb.RegisterRequest{Labels: map[string]string{"jumpstarter.dev/name": name}}); err != nil {
		stop()
		return nil, fmt.Errorf("register %s: %w", name, err)
	}
	stream, err := cs.Status(sctx, &pb.StatusRequest{})
	if err == nil {
		_, err = stream.Recv()
	}
	if err == nil {
		_, err = cs.ReportStatus(ectx, &pb.ReportStatusRequest{Status: pb.ExporterStatus_EXPORTER_STATUS_AVAILABLE})
	}
	if err != nil {
		stop()
		return nil, fmt.Errorf("status of %s: %w", name, err)
	}
	go func() { // drain lease updates until stopped
		for {
			if _, err := stream.Recv(); err != nil {
				return
			}
		}
	}()
	return stop, nil
}

// TestFakeFollowsUpstreamLeaseRules runs the mirror against a real API
// server with Jumpstarter's CRDs and a raw-protocol exporter on jstest.
func TestFakeFollowsUpstreamLeaseRules(t *testing.T) {
	if testing.Short() {
		t.Skip("needs the control plane")
	}
	fakeFollowsUpstreamLeaseRules(t, &env)
}

func fakeFollowsUpstreamLeaseRules(t *testing.T, e *apiEnv) {
	c := e.client
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	ns := e.namespace(t)

	ctl, err := jstest.Start(jstest.Options{Insecure: true})
	require.NoError(t, err)
	t.Cleanup(ctl.Close)
	f := &Fake{Client: c, Ctl: ctl, Namespace: ns, Interval: 50 * time.Millisecond, Log: logr.Discard()}
	go f.Run(ctx)

	getLease := func(name string) *jsv1.Lease {
		var l jsv1.Lease
		require.NoError(t, c.Get(ctx, types.NamespacedName{Namespace: ns, Name: name}, &l))
		return &l
	}
	getExp := func(name string) *jsv1.Exporter {
		var e jsv1.Exporter
		require.NoError(t, c.Get(ctx, types.NamespacedName{Namespace: ns, Name: name}, &e))
		return &e
	}
	newLease := func(name string, sel map[string]string) {
		require.NoError(t, c.Create(ctx, &jsv1.Lease{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
			Spec: jsv1.LeaseSpec{ClientRef: corev1.LocalObjectReference{Name: "ci"}, Selector: metav1.LabelSelector{MatchLabels: sel},
				Duration: &metav1.Duration{Duration: time.Hour}}}))
	}

	// Credential.
	require.NoError(t, c.Create(ctx, &jsv1.Exporter{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "e1", Labels: map[string]string{"board": "x"}}}))
	var token string
	eventually(t, "credential of e1", func() (bool, string) {
		e := getExp("e1")
		if e.Status.Credential == nil || e.Status.Endpoint != ctl.Endpoint() {
			return false, fmt.Sprint(e.Status)
		}
		var s corev1.Secret
		if err := c.Get(ctx, types.NamespacedName{Namespace: ns, Name: e.Status.Credential.Name}, &s); err != nil {
			return false, err.Error()
		}
		token = string(s.Data["token"])
		return token != "" && e.Status.Credential.Name == "e1-exporter", ""
	})

	// No match: Unsatisfiable, ended. Offline match: Pending Offline, waits.
	newLease("nomatch", map[string]string{"board": "y"})
	newLease("wait", map[string]string{"board": "x"})
	eventually(t, "nomatch ended Unsatisfiable", func() (bool, string) {
		l := getLease("nomatch")
		return l.Status.Ended && meta.IsStatusConditionTrue(l.Status.Conditions, jsv1.LeaseConditionUnsatisfiable), fmt.Sprint(l.Status)
	})
	eventually(t, "wait Pending Offline", func() (bool, string) {
		l := getLease("wait")
		c := meta.FindStatusCondition(l.Status.Conditions, jsv1.LeaseConditionPending)
		return c != nil && c.Reason == "Offline" && !l.Status.Ended, fmt.Sprint(l.Status)
	})

	// All matches disabled: Unsatisfiable AllDisabled.
	require.NoError(t, c.Create(ctx, &jsv1.Exporter{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "e2", Labels: map[string]string{"board": "z"}},
		Spec: jsv1.ExporterSpec{Enabled: new(false)}}))
	newLease("disabled", map[string]string{"board": "z"})
	eventually(t, "disabled ended AllDisabled", func() (bool, string) {
		l := getLease("disabled")
		c := meta.FindStatusCondition(l.Status.Conditions, jsv1.LeaseConditionUnsatisfiable)
		return l.Status.Ended && c != nil && c.Reason == "AllDisabled", fmt.Sprint(l.Status)
	})

	// The exporter comes online: the waiting lease lands on it.
	stop, err := goOnline(ctx, ctl.Endpoint(), token, ns, "e1")
	require.NoError(t, err)
	defer stop()
	eventually(t, "wait assigned to e1", func() (bool, string) {
		l := getLease("wait")
		return l.Status.ExporterRef != nil && l.Status.ExporterRef.Name == "e1" && meta.IsStatusConditionTrue(l.Status.Conditions, jsv1.LeaseConditionReady), fmt.Sprint(l.Status)
	})
	eventually(t, "e1 leaseRef and Online", func() (bool, string) {
		e := getExp("e1")
		return e.Status.LeaseRef != nil && e.Status.LeaseRef.Name == "wait" && meta.IsStatusConditionTrue(e.Status.Conditions, jsv1.ExporterConditionOnline) &&
			e.Status.ExporterStatusValue == "Available", fmt.Sprint(e.Status)
	})
	st, _ := ctl.ExporterState(ns, "e1")
	assert.Equal(t, "wait", st.Lease, "jstest holds the lease")

	// A second lease waits: the only exporter is leased.
	newLease("second", map[string]string{"board": "x"})
	eventually(t, "second Pending NotAvailable", func() (bool, string) {
		c := meta.FindStatusCondition(getLease("second").Status.Conditions, jsv1.LeaseConditionPending)
		return c != nil && c.Reason == "NotAvailable", fmt.Sprint(c)
	})

	// Release: the lease ends, the exporter is free, the second one lands.
	l := getLease("wait")
	l.Spec.Release = true
	require.NoError(t, c.Update(ctx, l))
	eventually(t, "wait ended", func() (bool, string) {
		return getLease("wait").Status.Ended, ""
	})
	eventually(t, "second assigned after release", func() (bool, string) {
		l := getLease("second")
		return l.Status.ExporterRef != nil && l.Status.ExporterRef.Name == "e1", fmt.Sprint(l.Status)
	})
	st, _ = ctl.ExporterState(ns, "e1")
	assert.Equal(t, "second", st.Lease)
}

// TestFakeWakesOnWatch: with a client that can watch, a pass follows every
// change of an Exporter or a Lease: with an Interval of an hour, a new
// Exporter still gets its credential and a new Lease its exporterRef.
func TestFakeWakesOnWatch(t *testing.T) {
	if testing.Short() {
		t.Skip("needs the control plane")
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	ns := env.namespace(t)
	wc, err := client.NewWithWatch(env.cfg, client.Options{Scheme: env.scheme})
	require.NoError(t, err)
	ctl, err := jstest.Start(jstest.Options{Insecure: true})
	require.NoError(t, err)
	t.Cleanup(ctl.Close)
	f := &Fake{Client: wc, Ctl: ctl, Namespace: ns, Interval: time.Hour, Log: logr.Discard()}
	go f.Run(ctx)
	time.Sleep(200 * time.Millisecond) // the first pass and the watches start

	require.NoError(t, wc.Create(ctx, &jsv1.Exporter{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "w1", Labels: map[string]string{"board": "w"}}}))
	var token string
	eventually(t, "credential of w1 without an interval pass", func() (bool, string) {
		var e jsv1.Exporter
		if err := wc.Get(ctx, types.NamespacedName{Namespace: ns, Name: "w1"}, &e); err != nil || e.Status.Credential == nil {
			return false, fmt.Sprint(err, e.Status)
		}
		var s corev1.Secret
		if err := wc.Get(ctx, types.NamespacedName{Namespace: ns, Name: e.Status.Credential.Name}, &s); err != nil {
			return false, err.Error()
		}
		token = string(s.Data["token"])
		return token != "", ""
	})
	stop, err := goOnline(ctx, ctl.Endpoint(), token, ns, "w1")
	require.NoError(t, err)
	defer stop()
	time.Sleep(300 * time.Millisecond) // the pass jstest's change triggers

	start := time.Now()
	require.NoError(t, wc.Create(ctx, &jsv1.Lease{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "l"},
		Spec: jsv1.LeaseSpec{ClientRef: corev1.LocalObjectReference{Name: "ci"}, Selector: metav1.LabelSelector{MatchLabels: map[string]string{"board": "w"}},
			Duration: &metav1.Duration{Duration: time.Hour}}}))
	eventually(t, "lease l assigned without an interval pass", func() (bool, string) {
		var l jsv1.Lease
		if err := wc.Get(ctx, types.NamespacedName{Namespace: ns, Name: "l"}, &l); err != nil {
			return false, err.Error()
		}
		return l.Status.ExporterRef != nil && l.Status.ExporterRef.Name == "w1", fmt.Sprint(l.Status)
	})
	t.Logf("lease -> exporterRef in %s with the watch (interval 1h)", time.Since(start).Round(time.Millisecond))
}
