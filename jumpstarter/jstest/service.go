package jstest

// The controller service (jumpstarter.v1.ControllerService) as upstream's
// controller serves it.

import (
	"context"
	"errors"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/pb"
)

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
