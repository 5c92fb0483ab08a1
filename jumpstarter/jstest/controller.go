// Package jstest is a protocol-faithful, in-memory Jumpstarter controller
// and router (ControllerService and RouterService of jumpstarter.v1, with
// upstream's semantics as of jumpstarter-dev/jumpstarter b1f2bb41) and a Go
// client that does what `jmp`/`j` do through them. It is for tests: of the
// exporter here, and end-to-end tests that mirror Kubernetes objects
// (Exporter, Client, Lease) onto it. It knows nothing of Kubernetes.
//
// What it mirrors from upstream's controller (controller/internal/service):
// bearer-token authentication with jumpstarter-kind/-namespace/-name
// metadata and the real controller's codes and messages (a token it does
// not know: Unknown "failed to authenticate token"; before its OIDC is up,
// Options.AuthDelay: Unknown "oidc: authenticator not initialized"; the
// named object missing: Unknown "exporter ns/x: exporters.jumpstarter.dev
// "x" not found"; another's token: PermissionDenied "permission denied for
// exporter ns/x"; wrong kind: InvalidArgument "object kind mismatch");
// Dial on an unknown lease: Unknown `leases.jumpstarter.dev "x" not
// found`, on an ended one: Unknown "lease not active", on another client's:
// Unknown "permission denied"; StopController restarts the controller
// alone (the router is another process upstream and keeps its streams);
// Register keeps only jumpstarter.dev/ labels; an exporter is
// Online while its Status stream is open; Status sends the lease state on
// open and on every change (never the same twice in a row); Listen needs the
// lease to be held by the exporter and a newer Listen supersedes an older;
// Dial needs the client to hold the lease, an assigned exporter whose
// reported status is LEASE_READY, a hook state or unset (Available is waited
// for up to Options.DialWait, upstream polls for 30 s; anything else is
// FailedPrecondition), and a listening exporter (else Unavailable); the
// router pairs the two streams that present the same token and forwards
// frames unchanged.
package jstest

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/pb"
)

// Options configure a Controller.
type Options struct {
	// Insecure serves plaintext gRPC instead of TLS from a test CA.
	Insecure bool
	// DialWait is how long Dial waits for an exporter that reports
	// Available to report LEASE_READY (upstream: 30 s). Zero: 30 s.
	DialWait time.Duration
	// Log receives the controller's and router's events (tokens never).
	Log logr.Logger
	// AuthDelay: for this long after every (re)start of the controller,
	// every token is refused with upstream's Unknown "oidc: authenticator
	// not initialized" (the real controller's OIDC issuer needs ~10 s).
	AuthDelay time.Duration
}

// ExporterState is what the controller knows of one exporter.
type ExporterState struct {
	Namespace, Name string
	// Registered: Register succeeded and no Unregister came since.
	Registered    bool
	Registrations int
	Unregistered  bool
	// Online while at least one Status stream is open.
	Online bool
	// Labels are the jumpstarter.dev/ labels of the last Register.
	Labels  map[string]string
	Reports []*pb.DriverInstanceReport
	// Status is the last reported status (UNSPECIFIED before any report);
	// StatusHistory every reported status in order.
	Status        pb.ExporterStatus
	StatusMessage string
	StatusHistory []pb.ExporterStatus
	// Lease is the lease assigned to the exporter ("" when none).
	Lease string
}

type key struct{ ns, name string }

type exporterRec struct {
	token         string
	uid           string
	registered    bool
	registrations int
	unregistered  bool
	statusStreams int
	labels        map[string]string
	reports       []*pb.DriverInstanceReport
	status        pb.ExporterStatus
	statusMessage string
	history       []pb.ExporterStatus
	lease         string
}

type clientRec struct{ ns, name string }

type leaseRec struct {
	name, exporter, client string
	// ended: released or expired; the object stays (upstream keeps ended
	// Lease objects), Dial answers "lease not active".
	ended bool
}

type listenQueue struct {
	ch   chan *pb.ListenResponse
	done chan struct{}
	once sync.Once
}

func (q *listenQueue) close() { q.once.Do(func() { close(q.done) }) }

// Controller is the controller and router pair. All state lives under mu;
// changed is closed (and replaced) on every change.
type Controller struct {
	opts Options
	log  logr.Logger
	ca   *testCA

	mu           sync.Mutex
	exporters    map[key]*exporterRec
	exporterTok  map[string]key
	clientTok    map[string]clientRec
	leases       map[key]*leaseRec // by namespace and lease name
	listeners    map[key]*listenQueue
	streamTokens map[string]string // router token -> stream id
	changed      chan struct{}

	ctrlAddr, routerAddr       string
	ctrlSrv, routerSrv         *grpc.Server
	ctrlRunning, routerRunning bool
	authReadyAt                time.Time

	pending sync.Map // stream id -> *routerPeer
}

// Start runs a controller and a router on loopback ports.
func Start(opts Options) (*Controller, error) {
	if opts.DialWait <= 0 {
		opts.DialWait = 30 * time.Second
	}
	if opts.Log.GetSink() == nil {
		opts.Log = logr.Discard()
	}
	c := &Controller{
		opts: opts, log: opts.Log,
		exporters: map[key]*exporterRec{}, exporterTok: map[string]key{}, clientTok: map[string]clientRec{},
		leases: map[key]*leaseRec{}, listeners: map[key]*listenQueue{}, streamTokens: map[string]string{},
		changed: make(chan struct{}),
	}
	if !opts.Insecure {
		ca, err := newTestCA()
		if err != nil {
			return nil, fmt.Errorf("jstest: test CA: %w", err)
		}
		c.ca = ca
	}
	if err := c.listen("127.0.0.1:0", "127.0.0.1:0"); err != nil {
		return nil, err
	}
	return c, nil
}

func (c *Controller) serverOpts() []grpc.ServerOption {
	// upstream's default keepalive policy (internal/config)
	opts := []grpc.ServerOption{grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{
		MinTime: time.Second, PermitWithoutStream: true,
	})}
	if c.ca != nil {
		opts = append(opts, grpc.Creds(credentials.NewTLS(&tls.Config{
			Certificates: []tls.Certificate{c.ca.server}, MinVersion: tls.VersionTLS12,
		})))
	}
	return opts
}

func (c *Controller) listen(ctrlAddr, routerAddr string) error {
	if err := c.serveController(ctrlAddr); err != nil {
		return err
	}
	if err := c.serveRouter(routerAddr); err != nil {
		c.StopController()
		return err
	}
	return nil
}

func (c *Controller) serveController(addr string) error {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("jstest: controller listen on %s: %w", addr, err)
	}
	srv := grpc.NewServer(c.serverOpts()...)
	pb.RegisterControllerServiceServer(srv, &controllerService{c: c})
	c.mu.Lock()
	c.ctrlAddr, c.ctrlSrv, c.ctrlRunning = l.Addr().String(), srv, true
	c.authReadyAt = time.Now().Add(c.opts.AuthDelay)
	c.mu.Unlock()
	go func() { _ = srv.Serve(l) }()
	return nil
}

func (c *Controller) serveRouter(addr string) error {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("jstest: router listen on %s: %w", addr, err)
	}
	srv := grpc.NewServer(c.serverOpts()...)
	pb.RegisterRouterServiceServer(srv, &routerService{c: c})
	c.mu.Lock()
	c.routerAddr, c.routerSrv, c.routerRunning = l.Addr().String(), srv, true
	c.mu.Unlock()
	go func() { _ = srv.Serve(l) }()
	return nil
}

// Endpoint is the controller's address (host:port).
func (c *Controller) Endpoint() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.ctrlAddr
}

// RouterEndpoint is the router's address (host:port).
func (c *Controller) RouterEndpoint() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.routerAddr
}

// CABundle is the PEM CA that signs both servers' certificate (nil when
// Insecure).
func (c *Controller) CABundle() []byte {
	if c.ca == nil {
		return nil
	}
	return c.ca.caPEM
}

// Insecure reports whether the servers speak plaintext.
func (c *Controller) Insecure() bool { return c.ca == nil }

// Stop stops the controller and the router (every stream and connection
// fails, like a restarted process); the state (exporters, clients, leases)
// stays, as it does in Kubernetes. Start serves again on the same addresses.
func (c *Controller) Stop() {
	c.StopController()
	c.mu.Lock()
	rs, running := c.routerSrv, c.routerRunning
	c.routerRunning = false
	c.mu.Unlock()
	if running {
		rs.Stop()
	}
}

// StopController stops only the controller, as when upstream's controller
// process restarts: its streams (Status, Listen) and calls fail, the
// router (a separate process upstream) keeps forwarding the streams it
// paired. StartController serves again on the same address.
func (c *Controller) StopController() {
	c.mu.Lock()
	cs, running := c.ctrlSrv, c.ctrlRunning
	c.ctrlRunning = false
	c.mu.Unlock()
	if !running {
		return
	}
	cs.Stop()
	c.mu.Lock()
	for k, q := range c.listeners {
		q.close()
		delete(c.listeners, k)
	}
	c.notifyLocked()
	c.mu.Unlock()
}

// Start serves again (controller and router) on the addresses of the first
// Start after Stop.
func (c *Controller) Start() error {
	if err := c.StartController(); err != nil {
		return err
	}
	c.mu.Lock()
	running, ra := c.routerRunning, c.routerAddr
	c.mu.Unlock()
	if running {
		return nil
	}
	return retryListen(func() error { return c.serveRouter(ra) })
}

// StartController serves the controller again on its address after
// StopController (or Stop); the router is left as it is.
func (c *Controller) StartController() error {
	c.mu.Lock()
	running, ca := c.ctrlRunning, c.ctrlAddr
	c.mu.Unlock()
	if running {
		return nil
	}
	return retryListen(func() error { return c.serveController(ca) })
}

func retryListen(f func() error) error {
	var err error
	for i := 0; i < 50; i++ { // the old sockets may linger a moment
		if err = f(); err == nil {
			return nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	return err
}

// PendingStreams counts router streams waiting for their peer (e.g. the
// exporter's side of a connection a client never made).
func (c *Controller) PendingStreams() int {
	n := 0
	c.pending.Range(func(any, any) bool { n++; return true })
	return n
}

// Close stops both servers for good.
func (c *Controller) Close() { c.Stop() }

func (c *Controller) notifyLocked() {
	close(c.changed)
	c.changed = make(chan struct{})
}

func (c *Controller) notify() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.notifyLocked()
}

// Changed returns a channel closed at the next change of any state
// (exporter registration, online, status, leases).
func (c *Controller) Changed() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.changed
}

// WaitFor waits until cond (called without locks held) is true or ctx ends.
func (c *Controller) WaitFor(ctx context.Context, cond func() bool) error {
	for {
		ch := c.Changed()
		if cond() {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// WaitExporter waits until cond holds for the exporter's state and returns
// that state; on timeout the error shows the last state seen.
func (c *Controller) WaitExporter(ctx context.Context, ns, name string, cond func(ExporterState) bool) (ExporterState, error) {
	var last ExporterState
	err := c.WaitFor(ctx, func() bool {
		st, ok := c.ExporterState(ns, name)
		last = st
		return ok && cond(st)
	})
	if err != nil {
		return last, fmt.Errorf("exporter %s/%s: condition not met (last state: registered=%v online=%v status=%s lease=%q): %w",
			ns, name, last.Registered, last.Online, last.Status, last.Lease, err)
	}
	return last, nil
}
