package jumpstarter

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/experimental"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/internal/streamconn"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/pb"
)

// Timeouts of the exporter's unary calls to the controller.
const (
	callTimeout       = 10 * time.Second
	unregisterTimeout = 5 * time.Second
	// listenRetries bounds consecutive failed Listen attempts within one
	// lease before the whole controller session is restarted.
	listenRetries    = 5
	listenRetryDelay = 500 * time.Millisecond
)

// clientKeepalive pings the controller and the router every 20 s, idle or
// not, as upstream's Python exporter does (its controller permits pings
// every 1 s without streams), so a dead peer ends the session instead of
// leaving the exporter silently offline.
var clientKeepalive = grpc.WithKeepaliveParams(keepalive.ClientParameters{
	Time: 20 * time.Second, Timeout: 60 * time.Second, PermitWithoutStream: true,
})

// Flow-control windows of the client connections served through the
// router. Their round trip is the router's twice over, so grpc's default
// (64 KiB, grown by BDP pings that travel the same path) holds a file
// upload to a few tens of MB/s; a fixed window lets a flash run at the
// disk's rate. The window is also the most a stream buffers when its
// consumer is slower than the client.
const (
	innerStreamWindow = 4 << 20
	innerConnWindow   = 8 << 20
	innerBuffer       = 1 << 20
)

// Exporter is one target's exporter. New validates the configuration; Run
// drives it. The Run goroutine owns the connection state (State, the lease,
// what was reported to the controller); client connections are served by
// a local gRPC server on their own goroutines.
type Exporter struct {
	cfg    Config
	log    logr.Logger
	uuid   string
	labels map[string]string // Register's and GetReport's (report.go)
	tree   []*driver
	byUUID map[string]*driver
	creds  credentials.TransportCredentials

	logs       *LogBook // Config.Logs or the exporter's own
	status     sessionStatus
	endSession chan struct{} // EndSession -> Run: report AVAILABLE
	res        *resources    // open client_stream resources (resource.go)

	srv *grpc.Server
	lis *streamconn.Listener

	running atomic.Bool
	state   State           // owned by the Run goroutine
	runCtx  context.Context // Run's context, parent of every lease's
}

// New checks cfg and builds the exporter's driver tree.
func New(cfg Config) (*Exporter, error) {
	var missing []string
	for _, f := range []struct{ name, v string }{{"Endpoint", cfg.Endpoint}, {"Token", cfg.Token}, {"Namespace", cfg.Namespace}, {"Name", cfg.Name}} {
		if f.v == "" {
			missing = append(missing, f.name)
		}
	}
	if cfg.Target == nil {
		missing = append(missing, "Target")
	}
	if len(missing) > 0 {
		return nil, fmt.Errorf("jumpstarter exporter config: missing %v", missing)
	}
	if cfg.BackoffInitial <= 0 {
		cfg.BackoffInitial = time.Second
	}
	if cfg.BackoffMax <= 0 {
		cfg.BackoffMax = 30 * time.Second
	}
	if cfg.BackoffMax < cfg.BackoffInitial {
		cfg.BackoffMax = cfg.BackoffInitial
	}
	if cfg.Log.GetSink() == nil {
		cfg.Log = logr.Discard()
	}
	if _, ok := cfg.Target.(Displayer); cfg.Display && !ok {
		return nil, fmt.Errorf("jumpstarter exporter %s/%s: Display is set but the target has no display (not a Displayer)", cfg.Namespace, cfg.Name)
	}
	if cfg.Logs == nil {
		cfg.Logs = NewLogBook()
	}
	tree, err := buildTree(cfg.Namespace, cfg.Name, cfg.Ports, cfg.Display)
	if err != nil {
		return nil, fmt.Errorf("jumpstarter exporter %s/%s: %w", cfg.Namespace, cfg.Name, err)
	}
	creds, err := transportCredentials(cfg.CABundle, cfg.Insecure)
	if err != nil {
		return nil, fmt.Errorf("jumpstarter exporter %s/%s: %w", cfg.Namespace, cfg.Name, err)
	}
	e := &Exporter{
		cfg:        cfg,
		log:        cfg.Log.WithValues("exporter", cfg.Namespace+"/"+cfg.Name),
		uuid:       nameUUID(cfg.Namespace + "/" + cfg.Name),
		labels:     exporterLabels(cfg.Labels, cfg.Name),
		tree:       tree,
		byUUID:     map[string]*driver{},
		creds:      creds,
		endSession: make(chan struct{}, 1),
		res:        newResources(),
		lis:        streamconn.NewListener(),
		logs:       cfg.Logs,
	}
	for _, d := range tree {
		e.byUUID[d.uuid] = d
	}
	e.status.set(pb.ExporterStatus_EXPORTER_STATUS_AVAILABLE, "")
	// Client connections may ping while idle, as upstream's session server
	// permits (min_ping_interval_without_data 10 s, permit_without_calls).
	e.srv = grpc.NewServer(grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{
		MinTime: 10 * time.Second, PermitWithoutStream: true,
	}), grpc.InitialWindowSize(innerStreamWindow), grpc.InitialConnWindowSize(innerConnWindow),
		grpc.WriteBufferSize(innerBuffer), grpc.ReadBufferSize(innerBuffer),
		experimental.BufferPool(streamconn.BufferPool), grpc.ForceServerCodecV2(streamconn.Codec))
	srv := &server{e: e}
	pb.RegisterExporterServiceServer(e.srv, srv)
	pb.RegisterRouterServiceServer(e.srv, srv)
	return e, nil
}

// transportCredentials: TLS verified against caPEM (system roots when
// empty), or plaintext when insecure.
func transportCredentials(caPEM []byte, insec bool) (credentials.TransportCredentials, error) {
	if insec {
		return insecure.NewCredentials(), nil
	}
	tc := &tls.Config{MinVersion: tls.VersionTLS12}
	if len(caPEM) > 0 {
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(caPEM) {
			return nil, errors.New("CA bundle holds no PEM certificate")
		}
		tc.RootCAs = pool
	}
	return credentials.NewTLS(tc), nil
}

// setState reports s to the owner (Run goroutine only).
func (e *Exporter) setState(s State, err error) {
	if s == e.state && err == nil {
		return
	}
	e.state = s
	if err != nil {
		e.log.Info("exporter state", "state", s, "error", err.Error())
	} else {
		e.log.V(1).Info("exporter state", "state", s)
	}
	if e.cfg.OnState != nil {
		e.cfg.OnState(s, err)
	}
}

// Run registers with the controller and serves until ctx ends, reconnecting
// with backoff (retryDelay: BackoffInitial doubling to BackoffMax, at most
// 2 s for temporary failures; back to the initial delay after a session
// that got Online). A lease and its client connections survive a lost
// controller session. On ctx end it unregisters
// (best effort, short timeout), reports StateStopped and returns nil. A
// lease hook with onFailure exit that failed (hooks.go) ends it the same
// way, with an error wrapping ErrHookExit; with Config.ExitOnLeaseEnd the
// end of a lease does too, with ErrExitOnLeaseEnd (StateStopped). An
// Exporter runs once.
func (e *Exporter) Run(ctx context.Context) error {
	if !e.running.CompareAndSwap(false, true) {
		return errors.New("jumpstarter exporter: Run called twice")
	}
	go func() { _ = e.srv.Serve(e.lis) }()
	defer func() {
		_ = e.lis.Close()
		e.srv.Stop()
	}()

	e.runCtx = ctx
	backoff := e.cfg.BackoffInitial
	registered := false
	// The lease outlives controller sessions (upstream's exporter keeps
	// handle_lease running while its Status and Listen streams retry): a
	// controller restart must not cut the client connections of a lease.
	// Only a StatusResponse that ends or replaces it, or Run's end, stops it.
	var lease *leaseRun
	var hookExit error // a hook with onFailure exit failed
	defer func() {
		if lease != nil {
			lease.stop()
		}
	}()
	for {
		e.setState(StateConnecting, nil)
		var online, reg bool
		var err error
		online, reg, lease, err = e.session(ctx, lease)
		registered = registered || reg
		if ctx.Err() != nil {
			break
		}
		if errors.Is(err, ErrHookExit) || errors.Is(err, ErrExitOnLeaseEnd) {
			hookExit = err
			break
		}
		e.setState(StateFailed, err)
		var wait time.Duration
		wait, backoff = retryDelay(classify(err), online, backoff, e.cfg.BackoffInitial, e.cfg.BackoffMax)
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
		case <-t.C:
		}
		if ctx.Err() != nil {
			break
		}
	}
	if lease != nil {
		<-lease.stop() // Run returns with the lease's connections over
		lease = nil
	}
	if registered {
		e.unregister()
	}
	if errors.Is(hookExit, ErrExitOnLeaseEnd) {
		e.setState(StateStopped, nil)
		return hookExit
	}
	if hookExit != nil {
		e.setState(StateFailed, hookExit)
		return hookExit
	}
	e.setState(StateStopped, nil)
	return nil
}

// temporaryRetryMax caps the delay before retrying after a temporary
// failure (controller restarting, its authenticator not ready yet, a
// transport error): upstream's exporter retries its streams every 0.5-1 s,
// and the real controller's OIDC is ready ~10 s after it starts, so a
// doubling backoff would leave the exporter offline long after it is back.
const temporaryRetryMax = 2 * time.Second

// errClass is what a session's failure means for the retry.
type errClass int

const (
	// errTemporary: the controller is unreachable, restarting or still
	// starting; retry soon.
	errTemporary errClass = iota
	// errTokenRejected: the controller did not accept the token at all.
	errTokenRejected
	// errPermission: the token is valid but not this Exporter's (another
	// exporter's, a client's) or of the wrong kind.
	errPermission
	// errNoExporter: no Exporter object of that namespace/name.
	errNoExporter
)

// classify reads the gRPC error of a controller call the way the real
// controller (b1f2bb41) reports them: most auth failures come as code
// Unknown with a plain message.
func classify(err error) errClass {
	if err == nil {
		return errTemporary
	}
	st, ok := status.FromError(err) // also when wrapped
	if !ok {
		return errTemporary // transport, timeouts, stream ended
	}
	msg := st.Message()
	switch st.Code() {
	case codes.Unauthenticated:
		return errTokenRejected
	case codes.PermissionDenied:
		return errPermission
	case codes.InvalidArgument:
		if strings.Contains(msg, "kind mismatch") || strings.Contains(msg, "metadata") || strings.Contains(msg, "resource name") {
			return errPermission
		}
		if strings.Contains(msg, "authorization header") {
			return errTokenRejected
		}
	case codes.NotFound:
		return errNoExporter
	case codes.Unknown:
		switch {
		case strings.Contains(msg, "authenticator not initialized"):
			return errTemporary
		case strings.Contains(msg, "failed to authenticate token"):
			return errTokenRejected
		case strings.Contains(msg, "exporters.jumpstarter.dev") && strings.Contains(msg, "not found"):
			return errNoExporter
		case strings.Contains(msg, "permission denied"):
			return errPermission
		}
	}
	return errTemporary
}

// FailureReason names what a failed controller call means, in the words
// metrics use: "token_rejected" (the controller does not accept the token),
// "permission_denied" (a valid token, but not this Exporter's),
// "no_exporter" (no Exporter object of that namespace/name) or "temporary"
// (unreachable, restarting, still starting). The real controller reports
// most of these as code Unknown, so the gRPC code alone says little.
func FailureReason(err error) string {
	switch classify(err) {
	case errTokenRejected:
		return "token_rejected"
	case errPermission:
		return "permission_denied"
	case errNoExporter:
		return "no_exporter"
	default:
		return "temporary"
	}
}

// retryDelay decides how long to wait before the next session and the
// backoff after it, from the class of the last failure, whether that
// session got Online (which resets the backoff) and the current backoff.
// Temporary failures wait at most temporaryRetryMax; token, permission and
// missing-Exporter failures double up to max.
func retryDelay(c errClass, online bool, cur, initial, max time.Duration) (wait, next time.Duration) {
	if online {
		cur = initial
	}
	next = min(2*cur, max)
	if c == errTemporary {
		return min(cur, temporaryRetryMax), next
	}
	return cur, next
}

// dialController opens a client connection carrying the exporter's
// credentials on every call.
func (e *Exporter) dialController() (*grpc.ClientConn, error) {
	md := metadata.Pairs(
		"authorization", "Bearer "+e.cfg.Token,
		"jumpstarter-kind", "Exporter",
		"jumpstarter-namespace", e.cfg.Namespace,
		"jumpstarter-name", e.cfg.Name,
	)
	withMD := func(ctx context.Context) context.Context {
		return metadata.NewOutgoingContext(ctx, metadata.Join(md, mdFrom(ctx)))
	}
	return grpc.NewClient(e.cfg.Endpoint,
		grpc.WithTransportCredentials(e.creds), clientKeepalive,
		grpc.WithUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			return invoker(withMD(ctx), method, req, reply, cc, opts...)
		}),
		grpc.WithStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
			return streamer(withMD(ctx), desc, cc, method, opts...)
		}),
	)
}

func mdFrom(ctx context.Context) metadata.MD {
	md, _ := metadata.FromOutgoingContext(ctx)
	return md
}

// callError says which call to the controller failed and why, in terms a
// pod's owner can act on (the token itself is never in it: the controller
// does not echo it).
func (e *Exporter) callError(call string, err error) error {
	what := ""
	switch classify(err) {
	case errTokenRejected:
		what = "the controller rejected the exporter token (not a token it issued, or revoked; use the Exporter's current status.credential)"
	case errPermission:
		what = fmt.Sprintf("the token is not exporter %s/%s's (another exporter's or a client's token?)", e.cfg.Namespace, e.cfg.Name)
	case errNoExporter:
		what = fmt.Sprintf("the controller has no Exporter object %s/%s", e.cfg.Namespace, e.cfg.Name)
	default:
		if strings.Contains(err.Error(), "authenticator not initialized") {
			what = "the controller is still starting (its token authenticator is not ready yet; temporary)"
		}
	}
	if what != "" {
		return fmt.Errorf("%s at %s: %s: %w", call, e.cfg.Endpoint, what, err)
	}
	return fmt.Errorf("%s at %s: %w", call, e.cfg.Endpoint, err)
}

// leaseEvent is what a lease goroutine tells the Run goroutine.
type leaseEvent struct {
	lease *leaseRun
	open  bool  // Listen is open (first time in this lease)
	err   error // Listen failed for good
}

// session is one controller connection: Register, Status, leases. lease is
// the lease that survived the previous session (nil: none); the session
// hands back the one it ends with (its Listen stopped; the Run goroutine
// owns it). It returns when ctx ends or the connection fails (online: the
// Status stream answered; registered: Register succeeded).
func (e *Exporter) session(ctx context.Context, lease *leaseRun) (online, registered bool, _ *leaseRun, err error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer func() {
		if lease != nil {
			lease.stopListen() // Listen needs this session's connection
		}
	}()
	conn, err := e.dialController()
	if err != nil {
		return false, false, lease, fmt.Errorf("controller %s: %w", e.cfg.Endpoint, err)
	}
	defer conn.Close()
	ctl := pb.NewControllerServiceClient(conn)

	rctx, rcancel := context.WithTimeout(ctx, callTimeout)
	_, err = ctl.Register(rctx, &pb.RegisterRequest{Labels: e.labels, Reports: e.reports()})
	rcancel()
	if o := e.cfg.Observer; o != nil {
		o.Registration(err)
	}
	if err != nil {
		return false, false, lease, e.callError("register with the controller", err)
	}
	e.setState(StateRegistered, nil)

	st, err := ctl.Status(ctx, &pb.StatusRequest{})
	if err != nil {
		return false, true, lease, e.callError("open the status stream", err)
	}
	statusCh, statusErr := recvStatus(ctx, st)
	events := make(chan leaseEvent, 4)
	rep := &statusReporter{e: e, ctl: ctl}

	for {
		select {
		case <-ctx.Done():
			return online, true, lease, ctx.Err()
		case err := <-statusErr:
			if ctx.Err() != nil {
				return online, true, lease, ctx.Err()
			}
			if err == nil {
				err = errors.New("ended by the controller")
			}
			return online, true, lease, e.callError("status stream", err)
		case m := <-statusCh:
			if !online {
				online = true
				e.setState(StateOnline, nil)
			}
			cur := ""
			if lease != nil {
				cur = lease.name
			}
			step := onStatus(cur, m.GetLeased(), m.GetLeaseName(), rep.reported == pb.ExporterStatus_EXPORTER_STATUS_AVAILABLE)
			if step.stop {
				e.log.Info("lease ended", "lease", lease.name)
				e.logs.Add(LogEntry{Message: "lease " + lease.name + " ended"})
				lease.stop()
				lease = nil
				if err := e.afterLeasePhase(ctx, rep, &step); err != nil { // hooks.go
					return online, true, lease, err
				}
				if e.cfg.ExitOnLeaseEnd {
					e.log.Info("exporter exits on lease end (exitOnLeaseEnd)")
					return online, true, lease, ErrExitOnLeaseEnd
				}
			}
			if step.start != "" {
				e.log.Info("lease assigned", "lease", step.start, "client", m.GetClientName())
				e.logs.beginLease()
				e.logs.Add(LogEntry{Message: "lease " + step.start + " assigned to client " + m.GetClientName()})
				select { // an EndSession of an earlier lease is no news for this one
				case <-e.endSession:
				default:
				}
				lease = e.newLease(step.start)
			}
			if lease != nil && !lease.listening() {
				// a new lease, or one that outlived the last session
				e.listenOn(ctx, lease, ctl, events)
			}
			if step.start != "" {
				if err := e.beforeLeasePhase(ctx, rep, lease); err != nil { // hooks.go
					return online, true, lease, err
				}
			}
			if step.available != "" {
				if err := rep.available(ctx, step.available); err != nil {
					return online, true, lease, err
				}
			}
		case ev := <-events:
			if ev.lease != lease {
				continue // a lease already stopped
			}
			if ev.err != nil {
				return online, true, lease, ev.err
			}
			if ev.open {
				lease.open = true
				if err := e.leaseReady(ctx, rep, lease); err != nil { // hooks.go
					return online, true, lease, err
				}
			}
		case <-e.endSession:
			if lease != nil {
				if err := rep.report(ctx, pb.ExporterStatus_EXPORTER_STATUS_AVAILABLE, "Session ended by the client"); err != nil {
					return online, true, lease, err
				}
			}
		}
	}
}

// leaseStep is what the Run goroutine does on a StatusResponse.
type leaseStep struct {
	stop      bool   // stop the current lease
	start     string // start serving this lease
	available string // report AVAILABLE (and StateOnline) with this message
}

// onStatus decides leaseStep from the current lease ("" none), the
// controller's StatusResponse and whether AVAILABLE is what the controller
// last heard from this session.
func onStatus(current string, leased bool, leaseName string, reportedAvailable bool) leaseStep {
	if leased && leaseName != "" {
		if current == leaseName {
			return leaseStep{}
		}
		return leaseStep{stop: current != "", start: leaseName}
	}
	if current != "" {
		return leaseStep{stop: true, available: "Lease ended"}
	}
	if !reportedAvailable {
		return leaseStep{available: "Exporter registered and available"}
	}
	return leaseStep{}
}

// unregister tells the controller the exporter goes away (best effort).
func (e *Exporter) unregister() {
	conn, err := e.dialController()
	if err != nil {
		return
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), unregisterTimeout)
	defer cancel()
	ctl := pb.NewControllerServiceClient(conn)
	msg := "Exporter shutting down"
	if _, err := ctl.ReportStatus(ctx, &pb.ReportStatusRequest{Status: pb.ExporterStatus_EXPORTER_STATUS_OFFLINE, Message: &msg}); err != nil {
		e.log.Info("report offline on stop failed", "error", err.Error())
	}
	if _, err := ctl.Unregister(ctx, &pb.UnregisterRequest{Reason: "Exporter shutdown"}); err != nil {
		e.log.Info("unregister failed", "error", err.Error())
	}
}

// leaseRun is one lease: its context (from Run's, kept across controller
// sessions), the client connections it took and the router channels, and
// the Listen goroutine of the current session.
type leaseRun struct {
	name   string
	ctx    context.Context
	cancel context.CancelFunc
	// ready: the beforeLease hook passed (or there is none), with its
	// LEASE_READY message; open: Listen opened. Drivers are served once
	// both hold. Run goroutine only.
	ready, open bool
	readyMsg    string

	// Listen of the current session (Run goroutine only).
	listenCancel context.CancelFunc
	listenDone   chan struct{}

	mu      sync.Mutex
	conns   map[*streamconn.Conn]struct{}
	routers map[string]*grpc.ClientConn // by router endpoint
}

// newLease starts a lease's lifetime; its context ends with Run's (the
// Run goroutine's context is the parent of every session's).
func (e *Exporter) newLease(name string) *leaseRun {
	lctx, cancel := context.WithCancel(e.runCtx)
	return &leaseRun{name: name, ctx: lctx, cancel: cancel,
		conns: map[*streamconn.Conn]struct{}{}, routers: map[string]*grpc.ClientConn{}}
}

// listening reports whether a Listen goroutine runs for this session.
func (lr *leaseRun) listening() bool { return lr.listenCancel != nil }

// listenOn runs Listen for the lease on this session's controller client
// until the session (sctx) or the lease ends.
func (e *Exporter) listenOn(sctx context.Context, lr *leaseRun, ctl pb.ControllerServiceClient, events chan<- leaseEvent) {
	lctx, cancel := context.WithCancel(sctx)
	stopAfter := context.AfterFunc(lr.ctx, cancel)
	done := make(chan struct{})
	lr.listenCancel, lr.listenDone = func() { stopAfter(); cancel() }, done
	go func() {
		defer close(done)
		e.listen(lctx, lr, ctl, events)
	}()
}

// stopListen ends the current session's Listen and waits for it.
func (lr *leaseRun) stopListen() {
	if lr.listenCancel == nil {
		return
	}
	lr.listenCancel()
	<-lr.listenDone
	lr.listenCancel, lr.listenDone = nil, nil
}

// stop ends the lease: Listen, every connection (used or not), the router
// channels. It waits for the Listen goroutine, not for the connections:
// each gets its GOAWAY at once and its stream ends when the peer has ended
// it (within streamconn.CloseGrace: see streamconn.Conn.Close), then the
// router channels close; the returned channel is closed when that is done.
// Closing the channels at once would cancel the streams behind the GOAWAYs
// and could leave a client idle on a console waiting forever.
func (lr *leaseRun) stop() <-chan struct{} {
	lr.cancel()
	lr.mu.Lock()
	conns, routers := lr.conns, lr.routers
	lr.conns, lr.routers = nil, nil
	lr.mu.Unlock()
	for c := range conns {
		_ = c.Close()
	}
	lr.stopListen()
	done := make(chan struct{})
	go func() {
		defer close(done)
		for c := range conns {
			<-c.Finished()
		}
		for _, cc := range routers {
			_ = cc.Close()
		}
	}()
	return done
}

// listen keeps Listen open for the lease (until ctx, the session's and the
// lease's, ends) and hands each router token to a connection goroutine. The
// first open Listen of a session is announced (LEASE_READY); after
// listenRetries failures in a row the session is restarted.
func (e *Exporter) listen(ctx context.Context, lr *leaseRun, ctl pb.ControllerServiceClient, events chan<- leaseEvent) {
	send := func(ev leaseEvent) {
		select {
		case events <- ev:
		case <-ctx.Done():
		}
	}
	announced := false
	failures := 0
	for ctx.Err() == nil {
		ls, err := ctl.Listen(ctx, &pb.ListenRequest{LeaseName: lr.name})
		if err == nil {
			if !announced {
				announced = true
				send(leaseEvent{lease: lr, open: true})
			}
			for {
				m, rerr := ls.Recv()
				if rerr != nil {
					err = rerr
					break
				}
				failures = 0
				go e.serveConn(lr, m.GetRouterEndpoint(), m.GetRouterToken())
			}
		}
		if ctx.Err() != nil {
			return
		}
		failures++
		e.log.Info("listen stream ended", "lease", lr.name, "error", fmt.Sprint(err), "failures", failures)
		if failures >= listenRetries {
			send(leaseEvent{lease: lr, err: e.callError("listen on lease "+lr.name, err)})
			return
		}
		select {
		case <-time.After(listenRetryDelay):
		case <-ctx.Done():
		}
	}
}

// serveConn dials the router with one token and hands the stream, as a
// net.Conn, to the local gRPC server. A connection nobody uses waits on
// its own goroutine until the lease ends.
func (e *Exporter) serveConn(lr *leaseRun, endpoint, token string) {
	cc, err := lr.router(endpoint, e.creds)
	if err != nil {
		e.log.Info("router dial failed", "lease", lr.name, "router", endpoint, "error", err.Error())
		return
	}
	// Not canceled with the lease: the lease's end closes the connection
	// (GOAWAY first, then the stream: leaseRun.stop).
	sctx, cancel := context.WithCancel(context.WithoutCancel(lr.ctx))
	sctx = metadata.AppendToOutgoingContext(sctx, "authorization", "Bearer "+token)
	st, err := pb.NewRouterServiceClient(cc).Stream(sctx)
	if err != nil {
		cancel()
		e.log.Info("router stream failed", "lease", lr.name, "router", endpoint, "error", err.Error())
		return
	}
	c := streamconn.New(streamconn.Pooled(streamconn.ClientFrames(st)), cancel, "router:"+endpoint)
	if !lr.track(c) {
		_ = c.Close()
		return
	}
	go func() {
		<-c.Done()
		lr.untrack(c)
	}()
	e.lis.Put(lr.ctx, c)
}

func (lr *leaseRun) router(endpoint string, creds credentials.TransportCredentials) (*grpc.ClientConn, error) {
	lr.mu.Lock()
	defer lr.mu.Unlock()
	if lr.routers == nil {
		return nil, errors.New("lease ended")
	}
	if cc, ok := lr.routers[endpoint]; ok {
		return cc, nil
	}
	cc, err := grpc.NewClient(endpoint, grpc.WithTransportCredentials(creds), clientKeepalive,
		grpc.WithInitialWindowSize(innerStreamWindow), grpc.WithInitialConnWindowSize(innerConnWindow),
		experimental.WithBufferPool(streamconn.BufferPool), grpc.WithDefaultCallOptions(grpc.ForceCodecV2(streamconn.Codec)))
	if err != nil {
		return nil, err
	}
	lr.routers[endpoint] = cc
	return cc, nil
}

func (lr *leaseRun) track(c *streamconn.Conn) bool {
	lr.mu.Lock()
	defer lr.mu.Unlock()
	if lr.conns == nil {
		return false
	}
	lr.conns[c] = struct{}{}
	return true
}

func (lr *leaseRun) untrack(c *streamconn.Conn) {
	lr.mu.Lock()
	defer lr.mu.Unlock()
	if lr.conns != nil {
		delete(lr.conns, c)
	}
}
