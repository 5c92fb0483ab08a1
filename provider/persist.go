package provider

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/qemu-kubelet/qemu-kubelet/provider/internal/atomicfile"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
)

// ReasonFailedToRecordState is the Warning event of a pod whose state
// record (status.json) could not be written, e.g. on a full disk;
// ReasonRecordedState the Normal event once a write succeeds again.
const (
	ReasonFailedToRecordState = "FailedToRecordState"
	ReasonRecordedState       = "RecordedState"
)

// update changes the state under the lock, persists it and pushes it.
func (r *podRun) update(f func(st *podstatus.VMState)) {
	p, rec := r.node, r.rec
	rec.change(f)
	r.persist()
	p.push(rec)
}

// persist writes the pod's status.json and surfaces a failure: logged with
// the pod, a Warning event on the first failure of a streak and a Normal
// one when writing works again. A stale record is removed when the write
// fails, so the disk never claims a state the pod has left: a restart then
// recovers from what QEMU itself recorded (its spec, pidfile and exit
// record) instead of from an outdated status.
func (r *podRun) persist() {
	p, rec := r.node, r.rec
	err := rec.persist()
	rec.statusFile.mu.Lock()
	was := rec.statusFile.failing
	rec.statusFile.failing = err != nil
	rec.statusFile.mu.Unlock()
	pod := rec.podCopy()
	log := p.log.WithValues("pod", klog.KObj(pod), "uid", rec.uid)
	switch {
	case err != nil:
		log.Error(err, "Pod state not recorded on disk; a restart of qemu-kubelet recovers it from the VM alone")
		if !was {
			p.event(pod, corev1.EventTypeWarning, ReasonFailedToRecordState,
				fmt.Sprintf("Could not record the pod's state on the node (a restart of qemu-kubelet would lose it): %v", err))
		}
	case was:
		log.Info("Pod state recorded on disk again")
		p.event(pod, corev1.EventTypeNormal, ReasonRecordedState, "The pod's state is recorded on the node again")
	}
}

// persist writes status.json while the state dir exists. Writes are
// serialized and each writes the state as it is when its turn comes, so
// the newest state is the last written. On failure the stale record is
// removed (see podRun.persist) and the error says what failed.
func (rec *podVM) persist() error { return rec.write(true) }

// persistKeep is persist for a change its caller undoes when it cannot
// be written (a flash): the record on disk, which then still matches the
// pod, stays.
func (rec *podVM) persistKeep() error { return rec.write(false) }

func (rec *podVM) write(removeStale bool) error {
	rec.statusFile.mu.Lock()
	defer rec.statusFile.mu.Unlock()
	b, removed, err := rec.stateJSON()
	if removed {
		return nil
	}
	if _, serr := os.Stat(rec.dir); errors.Is(serr, os.ErrNotExist) {
		return nil // deleted (finishDelete removed the dir)
	}
	path := filepath.Join(rec.dir, StatusFileName)
	if err != nil {
		err = fmt.Errorf("encode VM state: %w", err)
	} else if err = atomicfile.Write(path, append(b, '\n')); err != nil {
		err = fmt.Errorf("write %s: %w", path, err)
	}
	if err == nil || !removeStale {
		return err
	}
	if rerr := os.Remove(path); rerr != nil && !errors.Is(rerr, os.ErrNotExist) {
		err = errors.Join(err, fmt.Errorf("remove the stale %s: %w", path, rerr))
	}
	return err
}
