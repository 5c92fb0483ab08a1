package jumpstarter

import (
	"context"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/pb"
)

// A session's side of the controller's Status stream: receiving it and
// reporting the exporter's status back (exporter.go's session owns both).

// recvStatus receives the controller's Status stream on its own goroutine
// until the stream fails (its error on errc) or ctx ends.
func recvStatus(ctx context.Context, st pb.ControllerService_StatusClient) (<-chan *pb.StatusResponse, <-chan error) {
	ch := make(chan *pb.StatusResponse)
	errc := make(chan error, 1)
	go func() {
		for {
			m, err := st.Recv()
			if err != nil {
				errc <- err
				return
			}
			select {
			case ch <- m:
			case <-ctx.Done():
				return
			}
		}
	}()
	return ch, errc
}

// statusReporter reports the exporter's status to the controller, once
// per change; owned by one session's goroutine.
type statusReporter struct {
	e        *Exporter
	ctl      pb.ControllerServiceClient
	reported pb.ExporterStatus // last reported (UNSPECIFIED: none yet)
}

func (r *statusReporter) report(ctx context.Context, s pb.ExporterStatus, msg string) error {
	return r.reportRelease(ctx, s, msg, false)
}

// reportRelease reports s; release also asks the controller to release
// the active lease (a failed beforeLease hook).
func (r *statusReporter) reportRelease(ctx context.Context, s pb.ExporterStatus, msg string, release bool) error {
	r.e.status.set(s, msg)
	if r.reported == s && !release {
		return nil
	}
	rctx, rcancel := context.WithTimeout(ctx, callTimeout)
	defer rcancel()
	req := &pb.ReportStatusRequest{Status: s, Message: &msg}
	if release {
		req.ReleaseLease = &release
	}
	if _, err := r.ctl.ReportStatus(rctx, req); err != nil {
		return r.e.callError("report status "+s.String(), err)
	}
	r.reported = s
	return nil
}

// available reports AVAILABLE, and the exporter is Online.
func (r *statusReporter) available(ctx context.Context, msg string) error {
	if err := r.report(ctx, pb.ExporterStatus_EXPORTER_STATUS_AVAILABLE, msg); err != nil {
		return err
	}
	r.e.setState(StateOnline, nil)
	return nil
}
