// Command qemu-kubelet is the node agent of qemu-kubelet: it reads the node
// configuration file and flags, probes the host (QEMU, accelerator) and runs
// a virtual-kubelet node whose capacity is the host's VM capacity.
//
// Wiring only: decisions live in package provider and provider/config.
package main

import (
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/provider"
	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	"github.com/qemu-kubelet/qemu-kubelet/provider/nodestatus"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	vklog "github.com/virtual-kubelet/virtual-kubelet/log"
	vklogklog "github.com/virtual-kubelet/virtual-kubelet/log/klogv2"
	"github.com/virtual-kubelet/virtual-kubelet/node/nodeutil"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apiserver/pkg/server/dynamiccertificates"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"
)

// version is the qemu-kubelet version, set with
// -ldflags "-X main.version=v1.2.3"; it is the node's kubeletVersion.
var version = "v0.1.0-dev"

type options struct {
	configFile               string
	kubeconfig               string
	nodeName                 string
	kubeAPIQPS, kubeAPIBurst int
	showVersion              bool
	stopVMsUnlessOwner       bool
	obs                      observabilityOptions // observability.go
}

func main() {
	os.Exit(run())
}

// newFlagSet registers every flag of qemu-kubelet, klog's included, into o
// (the flag table of docs/node-config.md is checked against it).
func newFlagSet(o *options) *flag.FlagSet {
	fs := flag.NewFlagSet("qemu-kubelet", flag.ContinueOnError)
	fs.StringVar(&o.configFile, "config", "", "path to the NodeConfiguration file (apiVersion "+config.APIVersion+"); empty: all defaults")
	fs.StringVar(&o.kubeconfig, "kubeconfig", "", "kubeconfig with the node's credentials (default $KUBECONFIG, else in-cluster)")
	fs.StringVar(&o.nodeName, "node-name", "", "node name; overrides nodeName of the config file")
	fs.BoolVar(&o.showVersion, "version", false, "print the version and exit")
	fs.BoolVar(&o.stopVMsUnlessOwner, "stop-vms-unless-owner-exists", false, "in a DaemonSet pod (POD_NAMESPACE, POD_NAME): on SIGTERM stop every VM if the pod's DaemonSet is gone (uninstalled); otherwise VMs keep running for the next agent")
	fs.IntVar(&o.kubeAPIQPS, "kube-api-qps", 0, "API client QPS; overrides kubeAPIQPS of the config file (default 50)")
	fs.IntVar(&o.kubeAPIBurst, "kube-api-burst", 0, "API client burst; overrides kubeAPIBurst of the config file (default 100)")
	o.obs.addFlags(fs)
	klog.InitFlags(fs)
	return fs
}

func run() int {
	var o options
	fs := newFlagSet(&o)
	if err := fs.Parse(os.Args[1:]); err != nil {
		return 2
	}
	if o.showVersion {
		fmt.Printf("qemu-kubelet %s\n", version)
		return 0
	}
	// SIGHUP reloads the configuration file (reload.go), never stops us.
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)

	cfg, err := loadConfig(o)
	if err != nil {
		fmt.Fprintf(os.Stderr, "qemu-kubelet: %v\n", err)
		return 1
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	logger := klog.Background().WithValues("node", cfg.NodeName)
	ctx = klog.NewContext(ctx, logger)
	vklog.L = vklogklog.New(vklog.Fields{"node": cfg.NodeName})

	if err := runNode(ctx, o, cfg, hup); err != nil {
		logger.Error(err, "qemu-kubelet failed")
		klog.Flush()
		return 1
	}
	logger.Info("qemu-kubelet stopped")
	klog.Flush()
	return 0
}

// loadConfig reads the file (if any), applies flag overrides, defaults and
// validation. Nothing here talks to the API server.
func loadConfig(o options) (*config.Node, error) {
	file := &config.NodeConfiguration{APIVersion: config.APIVersion, Kind: config.Kind}
	where := "default configuration"
	if o.configFile != "" {
		var err error
		if file, err = config.Load(o.configFile); err != nil {
			return nil, err
		}
		where = "config file " + o.configFile
	}
	if o.nodeName != "" {
		file.NodeName = o.nodeName
	}
	if o.kubeAPIQPS != 0 {
		v := int32(o.kubeAPIQPS)
		file.KubeAPIQPS = &v
	}
	if o.kubeAPIBurst != 0 {
		v := int32(o.kubeAPIBurst)
		file.KubeAPIBurst = &v
	}
	hostname, _ := os.Hostname()
	var memTotal int64
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		memTotal, _, _ = nodestatus.ParseMeminfo(b) // unknown (0): maxVMs falls back to its fixed default
	}
	n, err := config.Resolve(file, config.Environment{Hostname: hostname, HostIP: firstHostIPv4(), MemoryTotal: memTotal,
		AgentUID: uint32(os.Geteuid()), AgentGID: uint32(os.Getegid())})
	if err != nil {
		return nil, fmt.Errorf("%s: %w", where, err)
	}
	return n, nil
}

func firstHostIPv4() string {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return ""
	}
	for _, a := range addrs {
		if ipn, ok := a.(*net.IPNet); ok && ipn.IP.To4() != nil && !ipn.IP.IsLoopback() && !ipn.IP.IsLinkLocalUnicast() {
			return ipn.IP.String()
		}
	}
	return ""
}

func restConfig(kubeconfig string) (*rest.Config, error) {
	if kubeconfig == "" {
		kubeconfig = os.Getenv("KUBECONFIG")
	}
	var rc *rest.Config
	var err error
	if kubeconfig == "" {
		rc, err = rest.InClusterConfig()
	} else {
		rc, err = clientcmd.BuildConfigFromFlags("", kubeconfig)
	}
	if err != nil {
		return nil, fmt.Errorf("client configuration (kubeconfig %q): %w", kubeconfig, err)
	}
	rc.UserAgent = "qemu-kubelet/" + version
	return rc, nil
}

// apiClients are the node's API clients. Like the kubelet: the main client
// has the kubeAPIQPS/Burst budget and events go through a client of their
// own (eventRecordQPS/eventBurst), so a flood of events never delays a pod
// status write or a delete.
func apiClients(rc *rest.Config, cfg *config.Node) (client, eventClient kubernetes.Interface, err error) {
	mrc := rest.CopyConfig(rc)
	mrc.QPS, mrc.Burst = cfg.KubeAPIQPS, cfg.KubeAPIBurst
	client, err = kubernetes.NewForConfig(mrc)
	if err != nil {
		return nil, nil, fmt.Errorf("create client: %w", err)
	}
	erc := rest.CopyConfig(rc)
	erc.QPS, erc.Burst = cfg.EventRecordQPS, cfg.EventBurst
	eventClient, err = kubernetes.NewForConfig(erc)
	if err != nil {
		return nil, nil, fmt.Errorf("create event client: %w", err)
	}
	return client, eventClient, nil
}

// probe gathers the facts fixed for the life of the process, for one node
// (the main one or a guest-architecture one: cfg.GuestArch).
func probe(ctx context.Context, cfg *config.Node) nodestatus.Facts {
	logger := klog.FromContext(ctx)
	f := nodestatus.Facts{Config: cfg, Version: version, Host: nodestatus.ReadHostInfo()}
	if v, err := qemu.Version(ctx, cfg.QEMUBinary); err != nil {
		logger.Error(err, "QEMU version unknown", "binary", cfg.QEMUBinary)
	} else {
		f.QEMUVersion = v
	}
	arch, _ := qemu.ParseArch(cfg.GuestArch) // validated by config; "" = the host's
	res, err := qemu.ProbeAccelerator(ctx, qemu.ProbeOptions{
		Arch:       arch,
		QEMUBinary: cfg.QEMUBinary,
		Policy:     qemu.AccelPolicy(cfg.AcceleratorPolicy),
		Timeout:    cfg.ProbeTimeout,
		WorkDir:    filepath.Join(cfg.StateDir, "probe"),
		RunAs:      provider.VMUserOf(cfg.VMUser),
	})
	f.Accelerator = nodestatus.Accelerator{Name: string(res.Accelerator), Reason: res.Reason, KVMError: res.KVMError}
	if err != nil {
		f.Accelerator.Name = ""
		f.Accelerator.Error = err.Error()
		logger.Error(err, "No usable accelerator; the node stays NotReady", "policy", cfg.AcceleratorPolicy)
	} else {
		logger.Info("Accelerator probed", "accelerator", res.Accelerator, "reason", res.Reason)
	}
	return f
}

// shared is what the nodes of one process share: API clients (unless a
// guest-architecture node has credentials of its own), the serving
// certificate and the kubelet API's TLS configuration, observability.
type shared struct {
	client, eventClient kubernetes.Interface
	tlsConfig           *tls.Config
	obs                 *observability
	// reload owns configuration reloads and the features in force.
	reload *configReloader
}

// clientsFor returns the API clients of node cfg: its own when it names a
// kubeconfig, else the shared ones.
func (sh *shared) clientsFor(cfg *config.Node) (client, eventClient kubernetes.Interface, err error) {
	if cfg.Kubeconfig == "" {
		return sh.client, sh.eventClient, nil
	}
	rc, err := restConfig(cfg.Kubeconfig)
	if err != nil {
		return nil, nil, err
	}
	return apiClients(rc, cfg)
}

// runNode runs the main node and one node per guest architecture
// (cfg.GuestArchitectures), each with its own node object and lease, pod
// controller (pods bound to its name), state dir, image cache and kubelet
// API port. The first node to fail stops them all.
func runNode(ctx context.Context, o options, cfg *config.Node, hup <-chan os.Signal) error {
	logger := klog.FromContext(ctx)
	if err := os.MkdirAll(cfg.StateDir, 0o750); err != nil {
		return fmt.Errorf("create state directory: %w", err)
	}
	if err := vmUserSearch(cfg); err != nil {
		return err
	}
	certFile, keyFile, err := servingCert(cfg)
	if err != nil {
		return err
	}
	rc, err := restConfig(o.kubeconfig)
	if err != nil {
		return err
	}
	var sh shared
	sh.client, sh.eventClient, err = apiClients(rc, cfg)
	if err != nil {
		return err
	}
	var tlsHolder nodeutil.NodeConfig
	if err := nodeutil.WithTLSConfig(nodeutil.WithKeyPairFromPath(certFile, keyFile))(&tlsHolder); err != nil {
		return fmt.Errorf("kubelet API TLS (%s, %s): %w", certFile, keyFile, err)
	}
	sh.tlsConfig = tlsHolder.TLSConfig
	sh.obs, err = startObservability(ctx, o.obs, cfg.NodeName, os.Getenv)
	if err != nil {
		return err
	}
	defer sh.obs.close(ctx)

	var owner *ownerWatch
	if o.stopVMsUnlessOwner {
		if owner, err = newOwnerWatch(ctx, sh.client); err != nil {
			return err
		}
	}

	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	if owner != nil {
		go owner.run(ctx)
	}
	sh.reload = newConfigReloader(o.configFile, cfg, func() (*config.Node, error) { return loadConfig(o) }, hup)
	go sh.reload.run(ctx)
	nodes := append([]*config.Node{cfg}, cfg.GuestArchitectures...)
	// Every node's accelerator is probed before any node starts a VM: the
	// VMs' transparent huge pages are decided for the process from all
	// of them.
	nctxs := make([]context.Context, len(nodes))
	facts := make([]nodestatus.Facts, len(nodes))
	for i, n := range nodes {
		nctxs[i] = ctx
		if i > 0 {
			nctxs[i] = klog.NewContext(ctx, klog.FromContext(ctx).WithValues("node", n.NodeName, "guestArch", n.GuestArch))
		}
		facts[i] = probe(nctxs[i], n)
	}
	if err := applyTHP(ctx, cfg.VMMemory.TransparentHugePages, facts); err != nil {
		return err
	}
	errs := make(chan error, len(nodes))
	for i, n := range nodes {
		go func() {
			err := runOneNode(nctxs[i], n, facts[i], &sh, i == 0)
			if err != nil && ctx.Err() == nil {
				err = fmt.Errorf("node %s: %w", n.NodeName, err)
				cancel(err)
			}
			errs <- err
		}()
	}
	var first error
	for range nodes {
		if err := <-errs; err != nil && first == nil && !errors.Is(err, context.Canceled) {
			first = err
		}
	}
	if cause := context.Cause(ctx); first == nil && cause != nil && !errors.Is(cause, context.Canceled) {
		first = cause
	}
	if first == nil {
		// SIGTERM/SIGINT: a clean stop; VMs keep running, unless the
		// agent is removed for good (--stop-vms-unless-owner-exists).
		logger.Info("Shut down on signal")
		if owner != nil {
			stopVMsIfOwnerGone(owner, nodes, 15*time.Second)
		}
	}
	return first
}

// applyTHP decides the VMs' transparent huge pages from the setting and
// the nodes' accelerators (provider.DecideTHP) and sets the process's
// flag, which the QEMUs it starts inherit (the agent's own memory then
// has no huge pages either). A failure is an error under Disabled; else
// logged, and the VMs keep the kernel's choice.
func applyTHP(ctx context.Context, setting string, facts []nodestatus.Facts) error {
	accels := make([]qemu.Accelerator, 0, len(facts))
	for _, f := range facts {
		accels = append(accels, qemu.Accelerator(f.Accelerator.Name))
	}
	d := provider.DecideTHP(setting, accels)
	logger := klog.FromContext(ctx)
	if err := provider.SetProcessTHP(d.Disable); err != nil {
		if setting == config.THPDisabled {
			return fmt.Errorf("vmMemory.transparentHugePages Disabled: %w", err)
		}
		logger.Error(err, "VMs' transparent huge pages left to the kernel", "disable", d.Disable, "why", d.Why)
		return nil
	}
	logger.Info("VMs' transparent huge pages", "disabled", d.Disable, "why", d.Why)
	return nil
}

// runOneNode runs one node until ctx ends (nil) or it fails. main: the
// host-architecture node, whose VMs and image cache the Prometheus state
// metrics describe; facts its probe's.
func runOneNode(ctx context.Context, cfg *config.Node, facts nodestatus.Facts, sh *shared, main bool) error {
	logger := klog.FromContext(ctx)
	if err := os.MkdirAll(cfg.StateDir, 0o750); err != nil {
		return fmt.Errorf("create state directory: %w", err)
	}
	client, eventClient, err := sh.clientsFor(cfg)
	if err != nil {
		return err
	}
	if main && cfg.VMMemory.EnableKSM {
		if err := nodestatus.EnableKSM(nodestatus.KSMDir, cfg.VMMemory.KSMPagesToScan); err != nil {
			return err
		}
		logger.Info("KSM started for mergeable guest RAM", "dir", nodestatus.KSMDir, "pagesToScan", cfg.VMMemory.KSMPagesToScan)
	}
	facts.ConfigState = sh.reload.State()
	host := nodestatus.HostSource{StateDir: cfg.StateDir, QEMUBinary: cfg.QEMUBinary}
	status := nodestatus.NewNodeStatus(ctx, facts, host.Read)
	images, imageDir, err := openImages(ctx, cfg)
	if err != nil {
		return err
	}
	defer images.Close()
	status.SetImages(func() []corev1.ContainerImage { return nodestatus.NodeImages(images.List()) })
	// Workers outlive nothing: on SIGTERM they detach and VMs keep running
	// for the next start to adopt.
	pods, err := newVMs(ctx, cfg, facts, client, images, imageDir, status.Allocatable, sh.obs.telemetry)
	if err != nil {
		return err
	}
	if main {
		if err := sh.obs.register(pods, images); err != nil {
			return err
		}
	}

	auth, err := nodeutil.WebhookAuth(client, cfg.NodeName, func(c *nodeutil.WebhookAuthConfig) error {
		if cfg.ClientCAFile == "" {
			return nil
		}
		ca, err := dynamiccertificates.NewDynamicCAContentFromFile("client-ca", cfg.ClientCAFile)
		if err != nil {
			return fmt.Errorf("server.clientCAFile: %w", err)
		}
		c.AuthnConfig.ClientCertificateCAContentProvider = ca
		return nil
	})
	if err != nil {
		return fmt.Errorf("kubelet API authentication: %w", err)
	}
	v := &vkNode{reload: sh.reload, cfg: cfg, client: client, eventClient: eventClient, status: status, pods: pods, auth: auth, tlsConfig: sh.tlsConfig, facts: facts,
		imageGC: nodestatus.ImageGC{Store: images, Period: cfg.Images.GCPeriod,
			Policy: oci.GCPolicy{MaxBytes: cfg.Images.GCMaxBytes, MaxAge: cfg.Images.GCMaxAge}}}

	logger.Info("Starting node", "version", version, "guestArch", cfg.GuestArch, "accelerator", facts.Accelerator.Name, "qemu", facts.QEMUVersion, "leaseDuration", cfg.LeaseDuration)
	err = v.run(ctx, func() { logger.Info("Node registered and running") })
	if ctx.Err() != nil {
		return nil
	}
	if err == nil {
		err = errors.New("node stopped unexpectedly")
	}
	return err
}
