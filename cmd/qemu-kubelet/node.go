package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"path"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/provider"
	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	"github.com/qemu-kubelet/qemu-kubelet/provider/kubeletapi"
	"github.com/qemu-kubelet/qemu-kubelet/provider/nodestatus"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/virtual-kubelet/virtual-kubelet/node"
	"github.com/virtual-kubelet/virtual-kubelet/node/api"
	"github.com/virtual-kubelet/virtual-kubelet/node/nodeutil"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"
)

// vkNode is the virtual-kubelet wiring: pod controller, node controller with
// lease, and the kubelet API server. It follows nodeutil.NewNode/Node.Run
// (virtual-kubelet v1.13) with two differences that NewNode cannot express:
//   - the lease duration and renew interval come from the config;
//   - secret/config map/service informers are never started: NewNode starts
//     them cluster-wide, which the Node authorizer forbids for a node
//     identity (it may only read objects its pods reference, by name) and
//     which no pod needs while pods are not started (downward API
//     resolution is skipped).
type vkNode struct {
	cfg    *config.Node
	client kubernetes.Interface
	// eventClient has its own rate limit (eventRecordQPS/eventBurst).
	eventClient kubernetes.Interface
	status      *nodestatus.NodeStatus
	pods        *provider.VMs
	facts       nodestatus.Facts
	imageGC     nodestatus.ImageGC
	auth        nodeutil.Auth
	tlsConfig   *tls.Config
	// reload applies configuration reloads to this node once it runs.
	reload *configReloader
}

func (v *vkNode) run(ctx context.Context, ready func()) error {
	logger := klog.FromContext(ctx)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()

	podFactory := informers.NewSharedInformerFactoryWithOptions(v.client, time.Minute, nodeutil.PodInformerFilter(v.cfg.NodeName))
	podInformer := podFactory.Core().V1().Pods()
	// The kubelet's status resync: a status someone else overwrote is
	// written back (provider/statusresync.go); the informer's periodic
	// resync makes it a check every minute as well.
	if _, err := podInformer.Informer().AddEventHandler(v.pods.StatusResyncHandler()); err != nil {
		return fmt.Errorf("pod status resync handler: %w", err)
	}
	// Never started: empty listers (see the type comment).
	unstarted := informers.NewSharedInformerFactory(v.client, time.Minute)

	eb := record.NewBroadcaster()
	eb.StartStructuredLogging(2)
	eb.StartRecordingToSink(&corev1client.EventSinkImpl{Interface: v.eventClient.CoreV1().Events(corev1.NamespaceAll)})
	defer eb.Shutdown()
	recorder := eb.NewRecorder(scheme.Scheme, corev1.EventSource{Component: path.Join(v.cfg.NodeName, "pod-controller"), Host: v.cfg.NodeName})
	v.pods.SetRecorder(eb.NewRecorder(scheme.Scheme, corev1.EventSource{Component: "qemu-kubelet", Host: v.cfg.NodeName}))

	pc, err := node.NewPodController(node.PodControllerConfig{
		// StatusWriter: a status written over labels set since the
		// provider copied the pod is retried with the stored ones.
		PodClient:                 podstatus.StatusWriter(v.client.CoreV1()),
		EventRecorder:             recorder,
		Provider:                  v.pods,
		PodInformer:               podInformer,
		SecretInformer:            unstarted.Core().V1().Secrets(),
		ConfigMapInformer:         unstarted.Core().V1().ConfigMaps(),
		ServiceInformer:           unstarted.Core().V1().Services(),
		SkipDownwardAPIResolution: true,
	})
	if err != nil {
		return fmt.Errorf("create pod controller: %w", err)
	}
	nc, err := node.NewNodeController(v.status, v.status.RegistrationNode(), v.client.CoreV1().Nodes(),
		node.WithNodeEnableLeaseV1WithRenewInterval(nodeutil.NodeLeaseV1Client(v.client), int32(v.cfg.LeaseDuration/time.Second), v.cfg.LeaseDuration/4),
	)
	if err != nil {
		return fmt.Errorf("create node controller: %w", err)
	}

	// Kubelet API: the provider routes (as nodeutil.AttachProviderRoutes
	// mounts them) behind webhook authentication and authorization.
	mux := http.NewServeMux()
	// kubeletapi.Handler: PodHandler with the port-forward timeouts the
	// right way round and kubelet streaming defaults (4h idle).
	// GateFeatures: attach and port-forward only while their features are on.
	mux.Handle("/", kubeletapi.GateFeatures(kubeletapi.Handler(api.PodHandlerConfig{
		RunInContainer:        v.pods.RunInContainer,
		AttachToContainer:     v.pods.AttachToContainer,
		GetContainerLogs:      v.pods.GetContainerLogs,
		GetPods:               v.pods.GetPods,
		GetPodsFromKubernetes: func(context.Context) ([]*corev1.Pod, error) { return podInformer.Lister().List(labels.Everything()) },
		GetStatsSummary:       v.pods.GetStatsSummary,
		GetMetricsResource:    v.pods.GetMetricsResource,
		PortForward:           v.pods.PortForward,
	}, true), v.cfg.NodeName, v.pods.Features))
	listen := net.JoinHostPort(v.cfg.ListenAddress, fmt.Sprint(v.cfg.Port))
	l, err := tls.Listen("tcp", listen, v.tlsConfig)
	if err != nil {
		return fmt.Errorf("kubelet API listen on %s: %w", listen, err)
	}
	srv := &http.Server{Handler: nodeutil.WithAuth(v.auth, mux), TLSConfig: v.tlsConfig, ReadHeaderTimeout: 30 * time.Second}
	go func() {
		if err := srv.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
			logger.Error(err, "Kubelet API server stopped")
		}
	}()
	defer srv.Close()
	logger.Info("Kubelet API serving", "address", listen)

	go podFactory.Start(ctx.Done())
	go v.status.Run(ctx)
	go pc.Run(ctx, v.cfg.PodSyncWorkers) //nolint:errcheck // reported through Done/Err
	defer func() { cancel(); <-pc.Done() }()
	select {
	case <-ctx.Done():
		return nil
	case <-pc.Ready():
	case <-pc.Done():
		return fmt.Errorf("pod controller: %w", pc.Err())
	}

	go nc.Run(ctx) //nolint:errcheck // reported through Done/Err
	defer func() { cancel(); <-nc.Done() }()
	select {
	case <-ctx.Done():
		return nil
	case <-nc.Ready():
	case <-nc.Done():
		return fmt.Errorf("node controller: %w", nc.Err())
	}
	ready()
	v.nodeEvents(ctx, eb)

	select {
	case <-ctx.Done():
		return nil
	case <-nc.Done():
		return fmt.Errorf("node controller exited: %w", nc.Err())
	case <-pc.Done():
		return fmt.Errorf("pod controller exited: %w", pc.Err())
	}
}

// nodeEvents records the node events (and registers the node for
// configuration reloads, reload.go): at start the accelerator in use (a
// warning when KVM was not usable and VMs fall back to TCG), then what the
// image cache garbage collection does (it runs until ctx ends).
func (v *vkNode) nodeEvents(ctx context.Context, eb record.EventBroadcaster) {
	rec := eb.NewRecorder(scheme.Scheme, corev1.EventSource{Component: "qemu-kubelet", Host: v.cfg.NodeName})
	ref := &corev1.ObjectReference{Kind: "Node", Name: v.cfg.NodeName, UID: types.UID(v.cfg.NodeName)}
	gc := v.imageGC
	gc.Event = func(typ, reason, msg string) { rec.Event(ref, typ, reason, msg) }
	if gc.Store != nil {
		go gc.Run(ctx)
	}
	if v.reload != nil {
		v.reload.register(ctx, reloadTarget{vms: v.pods, status: v.status, event: func(typ, reason, msg string) { rec.Event(ref, typ, reason, msg) }})
	}
	a := v.facts.Accelerator
	switch {
	case a.Error != "":
		rec.Event(ref, corev1.EventTypeWarning, "AcceleratorUnavailable", a.Error)
	case a.Name == "tcg" && a.KVMError != "":
		rec.Event(ref, corev1.EventTypeWarning, "AcceleratorFallback", a.Reason)
	default:
		rec.Event(ref, corev1.EventTypeNormal, "Accelerator", a.Reason)
	}
}
