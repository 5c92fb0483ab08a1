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
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

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

func randomToken() string {
	b := make([]byte, 24)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// AddExporter creates an exporter whose token is token ("" generates one);
// it returns the token.
func (c *Controller) AddExporter(ns, name, token string) string {
	if token == "" {
		token = randomToken()
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	k := key{ns, name}
	if old, ok := c.exporters[k]; ok {
		delete(c.exporterTok, old.token)
	}
	c.exporters[k] = &exporterRec{token: token, uid: randomUUID()}
	c.exporterTok[token] = k
	c.notifyLocked()
	return token
}

// RemoveExporter deletes an exporter (its token stops working, its Status
// streams end).
func (c *Controller) RemoveExporter(ns, name string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if r, ok := c.exporters[key{ns, name}]; ok {
		delete(c.exporterTok, r.token)
		delete(c.exporters, key{ns, name})
		c.notifyLocked()
	}
}

// AddClient creates a client with token ("" generates one); it returns
// the token.
func (c *Controller) AddClient(ns, name, token string) string {
	if token == "" {
		token = randomToken()
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.clientTok[token] = clientRec{ns, name}
	return token
}

// ExporterState returns what the controller knows of an exporter.
func (c *Controller) ExporterState(ns, name string) (ExporterState, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	r, ok := c.exporters[key{ns, name}]
	if !ok {
		return ExporterState{Namespace: ns, Name: name}, false
	}
	st := ExporterState{
		Namespace: ns, Name: name,
		Registered: r.registered, Registrations: r.registrations, Unregistered: r.unregistered,
		Online: r.statusStreams > 0,
		Status: r.status, StatusMessage: r.statusMessage, StatusHistory: slices.Clone(r.history),
		Lease:  r.lease,
		Labels: map[string]string{},
	}
	for k, v := range r.labels {
		st.Labels[k] = v
	}
	for _, rep := range r.reports {
		st.Reports = append(st.Reports, proto.Clone(rep).(*pb.DriverInstanceReport))
	}
	return st, true
}

// AssignLease assigns lease (in namespace ns) of client to exporter, as
// upstream's lease controller does once it picks an exporter.
func (c *Controller) AssignLease(ns, lease, exporter, client string) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	r, ok := c.exporters[key{ns, exporter}]
	if !ok {
		return fmt.Errorf("jstest: assign lease %s/%s: no exporter %s", ns, lease, exporter)
	}
	if r.lease != "" {
		return fmt.Errorf("jstest: assign lease %s/%s: exporter %s already holds lease %s", ns, lease, exporter, r.lease)
	}
	if l, ok := c.leases[key{ns, lease}]; ok && !l.ended {
		return fmt.Errorf("jstest: assign lease %s/%s: the lease exists", ns, lease)
	}
	c.leases[key{ns, lease}] = &leaseRec{name: lease, exporter: exporter, client: client}
	r.lease = lease
	c.notifyLocked()
	return nil
}

// EndLease ends a lease (the exporter's Status stream says leased=false).
func (c *Controller) EndLease(ns, lease string) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	l, ok := c.leases[key{ns, lease}]
	if !ok || l.ended {
		return fmt.Errorf("jstest: end lease %s/%s: no such lease", ns, lease)
	}
	l.ended = true
	if r, ok := c.exporters[key{ns, l.exporter}]; ok && r.lease == lease {
		r.lease = ""
	}
	c.notifyLocked()
	return nil
}

func randomUUID() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	b[6] = (b[6] & 0x0f) | 0x40
	b[8] = (b[8] & 0x3f) | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// notFound is the Kubernetes API's NotFound text, which upstream returns
// as a plain error (gRPC code Unknown).
func notFound(resource, name string) error {
	return fmt.Errorf("%s.jumpstarter.dev %q not found", resource, name)
}

// bearer extracts the bearer token of a call, as upstream's
// BearerTokenFromContext.
func bearer(ctx context.Context) (string, metadata.MD, error) {
	md, ok := metadata.FromIncomingContext(ctx)
	if !ok {
		return "", nil, status.Error(codes.InvalidArgument, "missing metadata")
	}
	auth := md.Get("authorization")
	if len(auth) == 0 {
		return "", nil, status.Error(codes.Unauthenticated, "missing authorization header")
	}
	if len(auth) > 1 {
		return "", nil, status.Error(codes.InvalidArgument, "multiple authorization headers")
	}
	if len(auth[0]) < 7 || !strings.EqualFold(auth[0][:7], "Bearer ") {
		return "", nil, status.Error(codes.InvalidArgument, "malformed authorization header")
	}
	return auth[0][7:], md, nil
}

func one(md metadata.MD, k string) string {
	if v := md.Get(k); len(v) == 1 {
		return v[0]
	}
	return ""
}

// identity is who a token authenticates (upstream: the OIDC user).
type identity struct {
	kind string // "Exporter" or "Client"
	key  key
}

// authenticate is upstream's VerifyExporterObjectToken/VerifyClientObjectToken
// for kind, with its codes and messages (b1f2bb41, seen live): token
// checks fail with code Unknown, the metadata names the object, the
// object must exist (else Unknown "<kind> ns/name: ... not found") and
// belong to the token (else PermissionDenied).
func (c *Controller) authenticate(ctx context.Context, kind string) (key, error) {
	tok, md, err := bearer(ctx)
	if err != nil {
		return key{}, err
	}
	c.mu.Lock()
	ready := !time.Now().Before(c.authReadyAt)
	var who identity
	known := false
	if k, ok := c.exporterTok[tok]; ok {
		who, known = identity{"Exporter", k}, true
	} else if cl, ok := c.clientTok[tok]; ok {
		who, known = identity{"Client", key{cl.ns, cl.name}}, true
	}
	c.mu.Unlock()
	if !ready {
		return key{}, errors.New("oidc: authenticator not initialized")
	}
	if !known {
		return key{}, errors.New("failed to authenticate token")
	}
	for _, mk := range []string{"jumpstarter-namespace", "jumpstarter-kind"} {
		switch n := len(md.Get(mk)); {
		case n == 0:
			return key{}, status.Errorf(codes.InvalidArgument, "missing metadata: %s", mk)
		case n > 1:
			return key{}, status.Errorf(codes.InvalidArgument, "multiple metadata: %s", mk)
		}
	}
	want := key{one(md, "jumpstarter-namespace"), one(md, "jumpstarter-name")}
	if want.name == "" {
		return key{}, status.Error(codes.InvalidArgument, "resource name required for pre-existing authentication")
	}
	if one(md, "jumpstarter-kind") != kind {
		return key{}, status.Error(codes.InvalidArgument, "object kind mismatch")
	}
	c.mu.Lock()
	exists := false
	if kind == "Exporter" {
		_, exists = c.exporters[want]
	} else {
		for _, cl := range c.clientTok {
			if cl.ns == want.ns && cl.name == want.name {
				exists = true
				break
			}
		}
	}
	c.mu.Unlock()
	lower := strings.ToLower(kind)
	if !exists {
		return key{}, fmt.Errorf("%s %s/%s: %w", lower, want.ns, want.name, notFound(lower+"s", want.name))
	}
	if who != (identity{kind, want}) {
		return key{}, status.Errorf(codes.PermissionDenied, "permission denied for %s %s/%s", lower, want.ns, want.name)
	}
	return want, nil
}

// authExporter returns the exporter a call comes from (c.mu not held).
func (c *Controller) authExporter(ctx context.Context) (key, error) {
	return c.authenticate(ctx, "Exporter")
}

func (c *Controller) authClient(ctx context.Context) (clientRec, error) {
	k, err := c.authenticate(ctx, "Client")
	if err != nil {
		return clientRec{}, err
	}
	return clientRec{k.ns, k.name}, nil
}

// withExporter runs f on the exporter's record under c.mu; NotFound when
// it was deleted meanwhile.
func (c *Controller) withExporter(k key, f func(r *exporterRec)) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	r, ok := c.exporters[k]
	if !ok {
		return status.Errorf(codes.NotFound, "exporter %s/%s not found", k.ns, k.name)
	}
	f(r)
	c.notifyLocked()
	return nil
}

type controllerService struct {
	pb.UnimplementedControllerServiceServer
	c *Controller
}

func (s *controllerService) Register(ctx context.Context, req *pb.RegisterRequest) (*pb.RegisterResponse, error) {
	k, err := s.c.authExporter(ctx)
	if err != nil {
		return nil, err
	}
	var uid string
	err = s.c.withExporter(k, func(r *exporterRec) {
		r.labels = map[string]string{}
		for lk, v := range req.GetLabels() {
			if strings.HasPrefix(lk, "jumpstarter.dev/") {
				r.labels[lk] = v
			}
		}
		r.reports = nil
		for _, rep := range req.GetReports() {
			r.reports = append(r.reports, proto.Clone(rep).(*pb.DriverInstanceReport))
		}
		r.registered, r.unregistered = true, false
		r.registrations++
		uid = r.uid
	})
	if err != nil {
		return nil, err
	}
	s.c.log.Info("exporter registered", "exporter", k.ns+"/"+k.name)
	return &pb.RegisterResponse{Uuid: uid}, nil
}

func (s *controllerService) Unregister(ctx context.Context, req *pb.UnregisterRequest) (*pb.UnregisterResponse, error) {
	k, err := s.c.authExporter(ctx)
	if err != nil {
		return nil, err
	}
	err = s.c.withExporter(k, func(r *exporterRec) {
		r.reports = nil
		r.registered, r.unregistered = false, true
		r.status, r.statusMessage = pb.ExporterStatus_EXPORTER_STATUS_OFFLINE, req.GetReason()
		r.history = append(r.history, r.status)
	})
	if err != nil {
		return nil, err
	}
	return &pb.UnregisterResponse{}, nil
}

func (s *controllerService) ReportStatus(ctx context.Context, req *pb.ReportStatusRequest) (*pb.ReportStatusResponse, error) {
	k, err := s.c.authExporter(ctx)
	if err != nil {
		return nil, err
	}
	err = s.c.withExporter(k, func(r *exporterRec) {
		r.status, r.statusMessage = req.GetStatus(), req.GetMessage()
		r.history = append(r.history, r.status)
		if req.GetReleaseLease() && r.lease != "" {
			if l, ok := s.c.leases[key{k.ns, r.lease}]; ok {
				l.ended = true
			}
			r.lease = ""
		}
	})
	if err != nil {
		return nil, err
	}
	return &pb.ReportStatusResponse{}, nil
}

// statusResponse is the lease state the Status stream sends (c.mu held).
func (c *Controller) statusResponseLocked(k key, r *exporterRec) *pb.StatusResponse {
	resp := &pb.StatusResponse{Leased: r.lease != ""}
	if r.lease != "" {
		ln := r.lease
		resp.LeaseName = &ln
		if l, ok := c.leases[key{k.ns, r.lease}]; ok {
			cn := l.client
			resp.ClientName = &cn
		}
	}
	return resp
}

func (s *controllerService) Status(_ *pb.StatusRequest, st pb.ControllerService_StatusServer) error {
	ctx := st.Context()
	k, err := s.c.authExporter(ctx)
	if err != nil {
		return err
	}
	if err := s.c.withExporter(k, func(r *exporterRec) { r.statusStreams++ }); err != nil {
		return err
	}
	defer func() {
		_ = s.c.withExporter(k, func(r *exporterRec) { r.statusStreams-- })
	}()
	var last *pb.StatusResponse
	for {
		s.c.mu.Lock()
		r, ok := s.c.exporters[k]
		var resp *pb.StatusResponse
		if ok {
			resp = s.c.statusResponseLocked(k, r)
		}
		ch := s.c.changed
		s.c.mu.Unlock()
		if !ok {
			return status.Errorf(codes.NotFound, "exporter %s/%s deleted", k.ns, k.name)
		}
		if last == nil || !proto.Equal(last, resp) {
			if err := st.Send(resp); err != nil {
				return err
			}
			last = resp
		}
		select {
		case <-ctx.Done():
			return nil
		case <-ch:
		}
	}
}

func (s *controllerService) Listen(req *pb.ListenRequest, st pb.ControllerService_ListenServer) error {
	ctx := st.Context()
	k, err := s.c.authExporter(ctx)
	if err != nil {
		return err
	}
	if req.GetLeaseName() == "" {
		return errors.New("empty lease name")
	}
	lk := key{k.ns, req.GetLeaseName()}
	q := &listenQueue{ch: make(chan *pb.ListenResponse, 8), done: make(chan struct{})}
	s.c.mu.Lock()
	l, ok := s.c.leases[lk]
	if !ok {
		s.c.mu.Unlock()
		return notFound("leases", lk.name) // upstream: the API error as is (code Unknown)
	}
	if l.ended || l.exporter != k.name {
		s.c.mu.Unlock()
		return errors.New("permission denied") // upstream: a plain error (code Unknown)
	}
	if old, ok := s.c.listeners[lk]; ok {
		old.close()
	}
	s.c.listeners[lk] = q
	s.c.notifyLocked()
	s.c.mu.Unlock()
	defer func() {
		s.c.mu.Lock()
		q.close()
		if s.c.listeners[lk] == q {
			delete(s.c.listeners, lk)
		}
		s.c.mu.Unlock()
	}()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-q.done:
			for {
				select {
				case m := <-q.ch:
					if err := st.Send(m); err != nil {
						return err
					}
				default:
					return nil
				}
			}
		case m := <-q.ch:
			if err := st.Send(m); err != nil {
				return err
			}
		}
	}
}

// dialable is upstream's checkExporterStatusForDriverCalls.
func dialable(s pb.ExporterStatus) error {
	switch s {
	case pb.ExporterStatus_EXPORTER_STATUS_LEASE_READY, pb.ExporterStatus_EXPORTER_STATUS_BEFORE_LEASE_HOOK,
		pb.ExporterStatus_EXPORTER_STATUS_AFTER_LEASE_HOOK, pb.ExporterStatus_EXPORTER_STATUS_UNSPECIFIED:
		return nil
	case pb.ExporterStatus_EXPORTER_STATUS_OFFLINE:
		return status.Error(codes.FailedPrecondition, "exporter is offline")
	case pb.ExporterStatus_EXPORTER_STATUS_AVAILABLE:
		return status.Error(codes.FailedPrecondition, "exporter is not ready (status: Available)")
	case pb.ExporterStatus_EXPORTER_STATUS_BEFORE_LEASE_HOOK_FAILED:
		return status.Error(codes.FailedPrecondition, "exporter beforeLease hook failed")
	case pb.ExporterStatus_EXPORTER_STATUS_AFTER_LEASE_HOOK_FAILED:
		return status.Error(codes.FailedPrecondition, "exporter afterLease hook failed")
	}
	return status.Errorf(codes.FailedPrecondition, "exporter not ready (status: %s)", s)
}

func (s *controllerService) Dial(ctx context.Context, req *pb.DialRequest) (*pb.DialResponse, error) {
	cl, err := s.c.authClient(ctx)
	if err != nil {
		return nil, err
	}
	if req.GetLeaseName() == "" {
		return nil, errors.New("empty lease name")
	}
	lk := key{cl.ns, req.GetLeaseName()}
	deadline := time.Now().Add(s.c.opts.DialWait)
	for {
		s.c.mu.Lock()
		l, ok := s.c.leases[lk]
		if !ok {
			s.c.mu.Unlock()
			return nil, notFound("leases", lk.name) // upstream: code Unknown
		}
		if l.client != cl.name {
			s.c.mu.Unlock()
			return nil, errors.New("permission denied")
		}
		if l.ended {
			s.c.mu.Unlock()
			return nil, errors.New("lease not active")
		}
		r, ok := s.c.exporters[key{cl.ns, l.exporter}]
		if !ok {
			s.c.mu.Unlock()
			return nil, errors.New("unable to get exporter referenced by lease")
		}
		st := r.status
		ch := s.c.changed
		if err := dialable(st); err == nil {
			break // keep the lock
		} else if st != pb.ExporterStatus_EXPORTER_STATUS_AVAILABLE || time.Now().After(deadline) {
			s.c.mu.Unlock()
			return nil, err
		}
		s.c.mu.Unlock()
		t := time.NewTimer(time.Until(deadline))
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, ctx.Err()
		case <-ch:
		case <-t.C:
		}
		t.Stop()
	}
	// c.mu held
	defer s.c.mu.Unlock()
	q, ok := s.c.listeners[lk]
	if !ok {
		return nil, status.Errorf(codes.Unavailable, "exporter is not listening on lease %s", lk.name)
	}
	select {
	case <-q.done:
		return nil, status.Errorf(codes.Unavailable, "exporter is not listening on lease %s", lk.name)
	default:
	}
	tok := randomToken()
	resp := &pb.ListenResponse{RouterEndpoint: s.c.routerAddr, RouterToken: tok}
	select {
	case q.ch <- resp:
	default:
		return nil, status.Errorf(codes.ResourceExhausted, "listener buffer full on lease %s", lk.name)
	}
	s.c.streamTokens[tok] = randomUUID()
	return &pb.DialResponse{RouterEndpoint: resp.RouterEndpoint, RouterToken: tok}, nil
}

type routerService struct {
	pb.UnimplementedRouterServiceServer
	c *Controller
}

type routerPeer struct {
	cancel context.CancelFunc
	stream pb.RouterService_StreamServer
}

// Stream pairs the two streams presenting the same token, like upstream's
// router_service.go: the first waits, the second forwards both ways.
func (s *routerService) Stream(st pb.RouterService_StreamServer) error {
	tok, _, err := bearer(st.Context())
	if err != nil {
		return status.Errorf(codes.Unauthenticated, "missing or invalid authorization: %v", err)
	}
	s.c.mu.Lock()
	id, ok := s.c.streamTokens[tok]
	s.c.mu.Unlock()
	if !ok {
		return status.Error(codes.Unauthenticated, "invalid router token")
	}
	ctx, cancel := context.WithCancel(st.Context())
	defer cancel()
	me := &routerPeer{cancel: cancel, stream: st}
	actual, loaded := s.c.pending.LoadOrStore(id, me)
	if loaded {
		first := actual.(*routerPeer)
		s.c.pending.CompareAndDelete(id, first)
		defer first.cancel()
		return forward(ctx, st, first.stream)
	}
	s.c.notify()
	defer s.c.notify()
	defer s.c.pending.CompareAndDelete(id, me)
	<-ctx.Done()
	return nil
}

func pipeFrames(a, b pb.RouterService_StreamServer) error {
	for {
		m, err := a.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		if err := b.Send(&pb.StreamResponse{Payload: m.GetPayload(), FrameType: m.GetFrameType()}); err != nil {
			return err
		}
	}
}

// forward is upstream's Forward: both directions until the first error
// (or both ends).
func forward(ctx context.Context, a, b pb.RouterService_StreamServer) error {
	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error { return pipeFrames(a, b) })
	g.Go(func() error { return pipeFrames(b, a) })
	go func() { _ = g.Wait() }()
	<-ctx.Done()
	return g.Wait()
}
