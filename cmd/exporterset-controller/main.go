// Command exporterset-controller runs the ExporterSet controller manager:
// it keeps each ExporterSet's pods and warm buffer of unleased pods (see
// docs/exporterset.md), with leader election, Prometheus metrics and health
// endpoints.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/healthz"
	"sigs.k8s.io/controller-runtime/pkg/metrics"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	jsv1 "github.com/qemu-kubelet/qemu-kubelet/api/jumpstarter/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	vtv1 "github.com/qemu-kubelet/qemu-kubelet/api/virtualtarget/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/controller"
)

type options struct {
	metricsAddr, healthAddr string
	leaderElect             bool
	leaderElectionNamespace string
	leaderElectionID        string
	workers                 int
	namespace               string
	qps                     float64
	burst                   int
	provisioner             string
	// upstreamOnly: --provisioner was given, as Jumpstarter's operator
	// starts a provisioner: only upstream's API is served (its Role grants
	// nothing else) and events go to the core API (the Role's).
	upstreamOnly bool
	// registry receives the controller's metrics; nil: controller-runtime's
	// (what /metrics serves). Tests that run twice in one process set it.
	registry prometheus.Registerer
}

func main() {
	var o options
	addFlags(flag.CommandLine, &o) // which holds --kubeconfig, registered by controller-runtime
	flag.Parse()
	flagsParsed(flag.CommandLine, &o)
	ctrl.SetLogger(klog.NewKlogr())

	err := func() error {
		cfg, err := ctrl.GetConfig()
		if err != nil {
			return fmt.Errorf("load kubeconfig: %w", err)
		}
		return run(ctrl.SetupSignalHandler(), cfg, o)
	}()
	if err != nil {
		klog.ErrorS(err, "exporterset-controller failed")
		klog.Flush()
		os.Exit(1)
	}
	klog.Flush()
}

// addFlags registers the controller's flags, klog's included, into o (the
// flag table of docs/exporterset.md is checked against them). --kubeconfig
// is controller-runtime's, registered on flag.CommandLine by its init.
func addFlags(fs *flag.FlagSet, o *options) {
	fs.StringVar(&o.metricsAddr, "metrics-bind-address", ":8080", "address of the Prometheus /metrics endpoint (0 disables it)")
	fs.StringVar(&o.healthAddr, "health-probe-bind-address", ":8081", "address of the /healthz and /readyz endpoints (0 disables them)")
	fs.BoolVar(&o.leaderElect, "leader-elect", false, "elect a leader so that only one replica reconciles")
	fs.StringVar(&o.leaderElectionNamespace, "leader-election-namespace", "", "namespace of the leader election Lease (default: the pod's namespace)")
	fs.StringVar(&o.leaderElectionID, "leader-election-id", "exporterset-controller.qemu-kubelet.io", "name of the leader election Lease")
	fs.IntVar(&o.workers, "workers", 4, "number of ExporterSets reconciled in parallel")
	fs.StringVar(&o.namespace, "namespace", "", "watch only this namespace (default: $NAMESPACE, else all)")
	fs.StringVar(&o.provisioner, "provisioner", vtv1.DefaultProvisioner, "the provisioner name this controller serves: upstream Jumpstarter's virtualtarget.jumpstarter.dev ExporterSets whose VirtualTargetClass names it")
	fs.Float64Var(&o.qps, "kube-api-qps", 50, "client-side rate limit of API requests per second (as kube-controller-manager)")
	fs.IntVar(&o.burst, "kube-api-burst", 100, "client-side burst of API requests (as kube-controller-manager)")
	klog.InitFlags(fs)
}

// flagsParsed completes o once fs is parsed: a --provisioner given on
// the command line serves upstream's API only.
func flagsParsed(fs *flag.FlagSet, o *options) {
	fs.Visit(func(f *flag.Flag) { o.upstreamOnly = o.upstreamOnly || f.Name == "provisioner" })
}

// run runs the manager until ctx ends.
func run(ctx context.Context, cfg *rest.Config, o options) error {
	if o.provisioner == "" {
		o.provisioner = vtv1.DefaultProvisioner
	}
	if o.namespace == "" {
		o.namespace = os.Getenv("NAMESPACE") // how Jumpstarter's operator scopes a provisioner
	}
	if o.leaderElectionNamespace == "" {
		// In a pod, "" is the pod's namespace; outside one, the watched
		// namespace (a provisioner's Role holds its Leases there).
		o.leaderElectionNamespace = o.namespace
	}
	if o.workers < 1 {
		return fmt.Errorf("--workers must be at least 1, got %d", o.workers)
	}
	cfg = rest.CopyConfig(cfg)
	cfg.QPS, cfg.Burst = float32(o.qps), o.burst
	scheme := runtime.NewScheme()
	if err := errors.Join(clientgoscheme.AddToScheme(scheme), v1alpha1.AddToScheme(scheme), jsv1.AddToScheme(scheme), vtv1.AddToScheme(scheme)); err != nil {
		return fmt.Errorf("build scheme: %w", err)
	}
	mopts := ctrl.Options{
		Scheme:                  scheme,
		Metrics:                 metricsserver.Options{BindAddress: o.metricsAddr},
		HealthProbeBindAddress:  o.healthAddr,
		LeaderElection:          o.leaderElect,
		LeaderElectionID:        o.leaderElectionID,
		LeaderElectionNamespace: o.leaderElectionNamespace,
	}
	if o.namespace != "" {
		mopts.Cache.DefaultNamespaces = map[string]cache.Config{o.namespace: {}}
	}
	mgr, err := ctrl.NewManager(cfg, mopts)
	if err != nil {
		return fmt.Errorf("create manager: %w", err)
	}
	var reg prometheus.Registerer = metrics.Registry
	if o.registry != nil {
		reg = o.registry
	}
	m, err := controller.NewMetrics(reg)
	if err != nil {
		return err
	}
	upstream, err := controller.UpstreamServed(mgr)
	if err != nil {
		return err
	}
	ours, err := controller.Served(mgr, v1alpha1.GroupVersion, "ExporterSet")
	if err != nil {
		return err
	}
	r := controller.NewReconciler(mgr.GetClient(), mgr.GetEventRecorder("exporterset-controller"), m)
	// Under Jumpstarter's operator (--provisioner) its Role grants upstream's
	// API alone: our own ExporterSet is then not watched, even when served.
	ours = ours && !o.upstreamOnly
	if o.upstreamOnly && !upstream {
		return fmt.Errorf("--provisioner %s: the API server does not serve virtualtarget.jumpstarter.dev/v1alpha1 ExporterSets and VirtualTargetClasses (Jumpstarter's operator installs them)", o.provisioner)
	}
	if ours || !upstream && !o.upstreamOnly {
		if err := r.SetupWithManager(mgr, o.workers); err != nil {
			return fmt.Errorf("set up exporterset controller: %w", err)
		}
	}
	upstreamJumpstarter := false
	if upstream {
		rec := mgr.GetEventRecorder("exporterset-controller")
		if o.upstreamOnly {
			//nolint:staticcheck // the core events API is the one upstream's Role grants
			rec = coreEvents{mgr.GetEventRecorderFor("exporterset-controller")}
		}
		u := controller.NewUpstreamReconciler(mgr.GetClient(), rec, o.provisioner)
		if err := u.SetupWithManager(mgr, o.workers); err != nil {
			return fmt.Errorf("set up virtualtarget exporterset controller: %w", err)
		}
		upstreamJumpstarter = u.Jumpstarter
	}
	if err := mgr.AddHealthzCheck("ping", healthz.Ping); err != nil {
		return fmt.Errorf("add healthz check: %w", err)
	}
	if err := mgr.AddReadyzCheck("ping", healthz.Ping); err != nil {
		return fmt.Errorf("add readyz check: %w", err)
	}
	klog.InfoS("starting exporterset-controller", "metrics", o.metricsAddr, "health", o.healthAddr, "leaderElect", o.leaderElect, "namespace", o.namespace,
		"jumpstarter", r.Jumpstarter, "qemu-kubelet.io", ours || !upstream && !o.upstreamOnly, "virtualtarget.jumpstarter.dev", upstream, "upstreamJumpstarter", upstreamJumpstarter, "provisioner", o.provisioner)
	if err := mgr.Start(ctx); err != nil {
		return fmt.Errorf("run manager: %w", err)
	}
	return nil
}

// coreEvents records events.EventRecorder events through the core
// (v1) events API: a provisioner's Role grants events in the core group,
// not events.k8s.io.
type coreEvents struct{ rec record.EventRecorder }

func (c coreEvents) Eventf(regarding, _ runtime.Object, eventtype, reason, _, note string, args ...any) {
	c.rec.Eventf(regarding, eventtype, reason, note, args...)
}
