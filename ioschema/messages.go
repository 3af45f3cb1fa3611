package ioschema

import (
	"encoding/json"
	"fmt"
	"reflect"
	"strings"

	"ebb/memory"
)

func init() {
	for _, f := range []func() Message{
		func() Message { return &GenerateReqInput{} },
		func() Message { return &GenerateReqOutput{} },
		func() Message { return &TokenizedGenerateReqInput{} },
		func() Message { return &BatchTokenIDOutput{} },
		func() Message { return &BatchStrOutput{} },
		func() Message { return &AbortReq{} },
		func() Message { return &ErrorOutput{} },
		func() Message { return &FlushCacheReqInput{} },
		func() Message { return &FlushCacheReqOutput{} },
		func() Message { return &PauseGenerationReqInput{} },
		func() Message { return &PauseGenerationReqOutput{} },
		func() Message { return &ContinueGenerationReqInput{} },
		func() Message { return &ContinueGenerationReqOutput{} },
		func() Message { return &ReleaseMemoryOccupationReqInput{} },
		func() Message { return &ReleaseMemoryOccupationReqOutput{} },
		func() Message { return &ResumeMemoryOccupationReqInput{} },
		func() Message { return &ResumeMemoryOccupationReqOutput{} },
		func() Message { return &UpdateWeightFromDiskReqInput{} },
		func() Message { return &UpdateWeightFromDiskReqOutput{} },
		func() Message { return &UpdateWeightsFromTensorReqInput{} },
		func() Message { return &UpdateWeightsFromTensorReqOutput{} },
		func() Message { return &InitWeightsUpdateGroupReqInput{} },
		func() Message { return &InitWeightsUpdateGroupReqOutput{} },
		func() Message { return &UpdateWeightsFromDistributedReqInput{} },
		func() Message { return &UpdateWeightsFromDistributedReqOutput{} },
		func() Message { return &DestroyWeightsUpdateGroupReqInput{} },
		func() Message { return &DestroyWeightsUpdateGroupReqOutput{} },
		func() Message { return &UpdateWeightVersionReqInput{} },
		func() Message { return &UpdateWeightVersionReqOutput{} },
		func() Message { return &GetWeightsByNameReqInput{} },
		func() Message { return &GetWeightsByNameReqOutput{} },
		func() Message { return &GetMemoryStatsReqInput{} },
		func() Message { return &GetMemoryStatsReqOutput{} },
		func() Message { return &GetServerInfoReqInput{} },
		func() Message { return &GetServerInfoReqOutput{} },
	} {
		register(f)
	}
}

// ---- generation -------------------------------------------------------------

// GenerateReqInput is /generate's body and the external socket's generate
// request: text or input_ids, single or batch.
type GenerateReqInput struct {
	Text                 Texts         `msgpack:"text" json:"text"`
	InputIDs             InputIDBatch  `msgpack:"input_ids" json:"input_ids"`
	SamplingParams       SamplingBatch `msgpack:"sampling_params" json:"sampling_params"`
	Rid                  Rids          `msgpack:"rid" json:"rid"`
	ReturnLogprob        bool          `msgpack:"return_logprob" json:"return_logprob"`
	LogprobStartLen      *int          `msgpack:"logprob_start_len" json:"logprob_start_len"`
	TopLogprobsNum       int           `msgpack:"top_logprobs_num" json:"top_logprobs_num"`
	ReturnTextInLogprobs bool          `msgpack:"return_text_in_logprobs" json:"return_text_in_logprobs"`
	Stream               bool          `msgpack:"stream" json:"stream"`
	// ReturnRoutedExperts returns, when the request finishes, the experts
	// each of its tokens was routed to, as meta_info.routed_experts (a
	// mixture-of-experts model served with --enable-return-routed-experts).
	ReturnRoutedExperts bool `msgpack:"return_routed_experts" json:"return_routed_experts"`
	// RoutedDPRank sends every prompt of the request to that data-parallel
	// engine instead of the least loaded one (SGLang's routed_dp_rank, as an
	// external router sets it). DataParallelRank is its deprecated spelling,
	// which sgl-model-gateway's dp-aware mode still sends; RoutedDPRank wins.
	RoutedDPRank     *int `msgpack:"routed_dp_rank" json:"routed_dp_rank"`
	DataParallelRank *int `msgpack:"data_parallel_rank" json:"data_parallel_rank"`
	UnsupportedGenerateFields
}

// UnsupportedGenerateFields are SGLang's GenerateReqInput fields that ebb
// does not carry out: parsed only so that a request setting one is refused
// by name (Unsupported) rather than served without it.
type UnsupportedGenerateFields struct {
	InputEmbeds          any `msgpack:"input_embeds" json:"input_embeds"`
	ImageData            any `msgpack:"image_data" json:"image_data"`
	VideoData            any `msgpack:"video_data" json:"video_data"`
	AudioData            any `msgpack:"audio_data" json:"audio_data"`
	TokenIDsLogprob      any `msgpack:"token_ids_logprob" json:"token_ids_logprob"`
	ReturnHiddenStates   any `msgpack:"return_hidden_states" json:"return_hidden_states"`
	ReturnEntropy        any `msgpack:"return_entropy" json:"return_entropy"`
	SessionParams        any `msgpack:"session_params" json:"session_params"`
	LoraPath             any `msgpack:"lora_path" json:"lora_path"`
	LoraID               any `msgpack:"lora_id" json:"lora_id"`
	CustomLogitProcessor any `msgpack:"custom_logit_processor" json:"custom_logit_processor"`
	BootstrapHost        any `msgpack:"bootstrap_host" json:"bootstrap_host"`
	BootstrapPort        any `msgpack:"bootstrap_port" json:"bootstrap_port"`
	BootstrapRoom        any `msgpack:"bootstrap_room" json:"bootstrap_room"`
}

// Unsupported is an error naming the fields of u a request sets (to other
// than null, false, zero or empty), or nil.
func (u *UnsupportedGenerateFields) Unsupported() error {
	var set []string
	v := reflect.ValueOf(u).Elem()
	for i := range v.NumField() {
		if isSet(v.Field(i).Interface()) {
			set = append(set, v.Type().Field(i).Tag.Get("json"))
		}
	}
	if len(set) == 0 {
		return nil
	}
	return fmt.Errorf("%s: not supported by ebb (text or input_ids in, tokens and logprobs out, one base model)",
		strings.Join(set, ", "))
}

// isSet says whether a decoded JSON or msgpack value is other than null,
// false, zero, "" or an empty list or map (a batch of nulls is unset too).
func isSet(v any) bool {
	rv := reflect.ValueOf(v)
	switch {
	case v == nil:
		return false
	case rv.Kind() == reflect.Slice:
		for i := 0; i < rv.Len(); i++ {
			if isSet(rv.Index(i).Interface()) {
				return true
			}
		}
		return false
	case rv.Kind() == reflect.Map:
		return rv.Len() > 0
	}
	return !rv.IsZero()
}

// TypeName implements Message.
func (*GenerateReqInput) TypeName() string { return "GenerateReqInput" }

// DPRank is the data-parallel engine the request asks for, or nil.
func (g *GenerateReqInput) DPRank() *int {
	if g.RoutedDPRank != nil {
		return g.RoutedDPRank
	}
	return g.DataParallelRank
}

// GenerateReqOutput is one generate result on the external socket; its
// fields are /generate's JSON response.
type GenerateReqOutput struct {
	Rid       string         `msgpack:"rid" json:"-"`
	Text      *string        `msgpack:"text" json:"text"`
	OutputIDs []int32        `msgpack:"output_ids" json:"output_ids"`
	MetaInfo  map[string]any `msgpack:"meta_info" json:"meta_info"`
	Finished  bool           `msgpack:"finished" json:"-"` // ebb: last message of a streamed request
}

// TypeName implements Message.
func (*GenerateReqOutput) TypeName() string { return "GenerateReqOutput" }

// TokenizedGenerateReqInput goes from the tokenizer manager to the scheduler.
type TokenizedGenerateReqInput struct {
	Rid             string         `msgpack:"rid"`
	InputText       string         `msgpack:"input_text"`
	InputIDs        Int32s         `msgpack:"input_ids"`
	SamplingParams  SamplingParams `msgpack:"sampling_params"`
	ReturnLogprob   bool           `msgpack:"return_logprob"`
	LogprobStartLen int            `msgpack:"logprob_start_len"`
	TopLogprobsNum  int            `msgpack:"top_logprobs_num"`
	Stream          bool           `msgpack:"stream"`
	// ReturnRoutedExperts: SGLang's field of the same name.
	ReturnRoutedExperts bool `msgpack:"return_routed_experts"`
}

// TypeName implements Message.
func (*TokenizedGenerateReqInput) TypeName() string { return "TokenizedGenerateReqInput" }

// tokenOutputs are the per-request fields shared by the scheduler's and the
// detokenizer's batches; index i of every slice belongs to Rids[i].
type tokenOutputs struct {
	Rids             []string        `msgpack:"rids"`
	FinishedReasons  []*FinishReason `msgpack:"finished_reasons"`
	OutputIDs        []Int32s        `msgpack:"output_ids"` // tokens new in this batch
	PromptTokens     []int           `msgpack:"prompt_tokens"`
	CompletionTokens []int           `msgpack:"completion_tokens"`
	CachedTokens     []int           `msgpack:"cached_tokens"`
	// Logprobs, present when the request asked (empty lists otherwise).
	OutputTokenLogprobsVal [][]float32   `msgpack:"output_token_logprobs_val"`
	OutputTopLogprobsVal   [][][]float32 `msgpack:"output_top_logprobs_val"`
	OutputTopLogprobsIdx   [][]Int32s    `msgpack:"output_top_logprobs_idx"`
	InputTokenLogprobsVal  [][]float32   `msgpack:"input_token_logprobs_val"`
	InputTokenLogprobsIdx  []Int32s      `msgpack:"input_token_logprobs_idx"`
	// Input top logprobs, with the input logprobs where top_logprobs_num
	// asked: a list per prompt position (nil for the first token).
	InputTopLogprobsVal [][][]float32 `msgpack:"input_top_logprobs_val"`
	InputTopLogprobsIdx [][]Int32s    `msgpack:"input_top_logprobs_idx"`
	// RoutedExperts, in a finished request's entry when it asked, are the
	// experts each token but the last was routed to, [tokens - 1, layers,
	// k] flattened (SGLang's routed_experts).
	RoutedExperts []Int32s `msgpack:"routed_experts"`
	// WeightVersion is the weights these tokens were produced with.
	WeightVersion string `msgpack:"weight_version"`
}

// BatchTokenIDOutput is one scheduler step's tokens, to the detokenizer.
type BatchTokenIDOutput struct {
	tokenOutputs               `msgpack:",inline"`
	SkipSpecialTokens          []bool     `msgpack:"skip_special_tokens"`
	SpacesBetweenSpecialTokens []bool     `msgpack:"spaces_between_special_tokens"`
	NoStopTrim                 []bool     `msgpack:"no_stop_trim"`
	Stop                       [][]string `msgpack:"stop"` // stop strings, for holding back partial matches
}

// TypeName implements Message.
func (*BatchTokenIDOutput) TypeName() string { return "BatchTokenIDOutput" }

// BatchStrOutput is the same batch as text, to the tokenizer manager.
type BatchStrOutput struct {
	tokenOutputs `msgpack:",inline"`
	OutputStrs   []string `msgpack:"output_strs"` // text new in this batch (whole characters)
}

// TypeName implements Message.
func (*BatchStrOutput) TypeName() string { return "BatchStrOutput" }

// Outputs exposes the shared per-request fields.
func (b *BatchStrOutput) Outputs() *tokenOutputs { return &b.tokenOutputs }

// Outputs exposes the shared per-request fields.
func (b *BatchTokenIDOutput) Outputs() *tokenOutputs { return &b.tokenOutputs }

// AbortReq aborts requests whose rid starts with Rid, or all of them.
type AbortReq struct {
	Rid      string `msgpack:"rid" json:"rid"`
	AbortAll bool   `msgpack:"abort_all" json:"abort_all"`
}

// TypeName implements Message.
func (*AbortReq) TypeName() string { return "AbortReq" }

// ErrorOutput answers a request that could not be carried out (ebb).
type ErrorOutput struct {
	Rid     string `msgpack:"rid" json:"rid"`
	Message string `msgpack:"message" json:"message"`
	// Request is the "type" of the failed request, when known.
	Request string `msgpack:"request" json:"request"`
}

// TypeName implements Message.
func (*ErrorOutput) TypeName() string { return "ErrorOutput" }

// ---- control ----------------------------------------------------------------

// Result is the common reply of control requests.
type Result struct {
	Rid     string `msgpack:"rid" json:"-"` // ebb: echoes the request's rid
	Success bool   `msgpack:"success" json:"success"`
	Message string `msgpack:"message" json:"message"`
	// DPRank is the data-parallel engine that answered; with several, the
	// tokenizer manager merges their replies and lists each in Engines (ebb).
	DPRank  int              `msgpack:"dp_rank" json:"-"`
	Engines []map[string]any `msgpack:"engines,omitempty" json:"engines,omitempty"`
	// TPRanks are the replies of a tensor-parallel engine's ranks 1.. (ebb).
	TPRanks []map[string]any `msgpack:"tp_ranks,omitempty" json:"tp_ranks,omitempty"`
}

// Detail is a reply as its JSON fields, for the per-engine and per-rank
// lists of a merged reply (an engine's keeps its ranks' replies).
func Detail(m Message) map[string]any {
	d := map[string]any{}
	if b, err := json.Marshal(m); err == nil {
		_ = json.Unmarshal(b, &d)
	}
	delete(d, "engines")
	return d
}

// GetRid returns the correlation id of a control message.
func (r *Result) GetRid() string { return r.Rid }

// ResultPtr gives access to the embedded Result of any control reply.
func (r *Result) ResultPtr() *Result { return r }

// Control is the request id every control message carries (ebb: replies
// echo it).
type Control struct {
	Rid string `msgpack:"rid,omitempty" json:"rid,omitempty"`
}

// GetRid returns the correlation id.
func (c *Control) GetRid() string { return c.Rid }

// SetRid sets the correlation id.
func (c *Control) SetRid(r string) { c.Rid = r }

// FlushCacheReqInput drops the radix cache.
type FlushCacheReqInput struct {
	Control `msgpack:",inline"`
}

// TypeName implements Message.
func (*FlushCacheReqInput) TypeName() string { return "FlushCacheReqInput" }

// FlushCacheReqOutput answers FlushCacheReqInput.
type FlushCacheReqOutput struct {
	Result `msgpack:",inline"`
}

// TypeName implements Message.
func (*FlushCacheReqOutput) TypeName() string { return "FlushCacheReqOutput" }

// Pause modes.
const (
	PauseAbort   = "abort"
	PauseRetract = "retract"
	PauseInPlace = "in_place"
)

// PauseGenerationReqInput stops scheduling.
type PauseGenerationReqInput struct {
	Control `msgpack:",inline"`
	Mode    string `msgpack:"mode" json:"mode"`
}

// TypeName implements Message.
func (*PauseGenerationReqInput) TypeName() string { return "PauseGenerationReqInput" }

func (p *PauseGenerationReqInput) applyDefaults() {
	if p.Mode == "" {
		p.Mode = PauseAbort // SGLang's default
	}
}

// PauseGenerationReqOutput answers PauseGenerationReqInput.
type PauseGenerationReqOutput struct {
	Result `msgpack:",inline"`
	// Aborted and Retracted count the requests the pause affected (ebb).
	Aborted   int `msgpack:"aborted" json:"aborted"`
	Retracted int `msgpack:"retracted" json:"retracted"`
}

// TypeName implements Message.
func (*PauseGenerationReqOutput) TypeName() string { return "PauseGenerationReqOutput" }

// ContinueGenerationReqInput resumes scheduling.
type ContinueGenerationReqInput struct {
	Control         `msgpack:",inline"`
	TorchEmptyCache bool `msgpack:"torch_empty_cache" json:"torch_empty_cache"`
}

// TypeName implements Message.
func (*ContinueGenerationReqInput) TypeName() string { return "ContinueGenerationReqInput" }

// ContinueGenerationReqOutput answers ContinueGenerationReqInput.
type ContinueGenerationReqOutput struct {
	Result `msgpack:",inline"`
	// Workspace reserved bytes before and after emptying the cache (ebb).
	ReservedBefore int64 `msgpack:"workspace_reserved_before" json:"workspace_reserved_before"`
	ReservedAfter  int64 `msgpack:"workspace_reserved_after" json:"workspace_reserved_after"`
}

// TypeName implements Message.
func (*ContinueGenerationReqOutput) TypeName() string { return "ContinueGenerationReqOutput" }

// ReleaseMemoryOccupationReqInput gives GPU memory back; no tags means all.
type ReleaseMemoryOccupationReqInput struct {
	Control `msgpack:",inline"`
	Tags    []string `msgpack:"tags" json:"tags"`
}

// TypeName implements Message.
func (*ReleaseMemoryOccupationReqInput) TypeName() string { return "ReleaseMemoryOccupationReqInput" }

// MemoryResult reports what a release or resume did per tag.
type MemoryResult struct {
	Result `msgpack:",inline"`
	Tags   []memory.Outcome `msgpack:"tags" json:"tags"`
}

// ReleaseMemoryOccupationReqOutput answers ReleaseMemoryOccupationReqInput.
type ReleaseMemoryOccupationReqOutput struct {
	MemoryResult `msgpack:",inline"`
}

// TypeName implements Message.
func (*ReleaseMemoryOccupationReqOutput) TypeName() string {
	return "ReleaseMemoryOccupationReqOutput"
}

// ResumeMemoryOccupationReqInput takes GPU memory again; no tags means all.
type ResumeMemoryOccupationReqInput struct {
	Control `msgpack:",inline"`
	Tags    []string `msgpack:"tags" json:"tags"`
}

// TypeName implements Message.
func (*ResumeMemoryOccupationReqInput) TypeName() string { return "ResumeMemoryOccupationReqInput" }

// ResumeMemoryOccupationReqOutput answers ResumeMemoryOccupationReqInput.
type ResumeMemoryOccupationReqOutput struct {
	MemoryResult `msgpack:",inline"`
}

// TypeName implements Message.
func (*ResumeMemoryOccupationReqOutput) TypeName() string { return "ResumeMemoryOccupationReqOutput" }

// UpdateWeightFromDiskReqInput loads new weights in place.
type UpdateWeightFromDiskReqInput struct {
	Control          `msgpack:",inline"`
	ModelPath        string  `msgpack:"model_path" json:"model_path"`
	LoadFormat       *string `msgpack:"load_format" json:"load_format"`
	FlushCache       *bool   `msgpack:"flush_cache" json:"flush_cache"`
	AbortAllRequests bool    `msgpack:"abort_all_requests" json:"abort_all_requests"`
	WeightVersion    *string `msgpack:"weight_version" json:"weight_version"`
	TorchEmptyCache  bool    `msgpack:"torch_empty_cache" json:"torch_empty_cache"`
}

// TypeName implements Message.
func (*UpdateWeightFromDiskReqInput) TypeName() string { return "UpdateWeightFromDiskReqInput" }

func (u *UpdateWeightFromDiskReqInput) applyDefaults() {
	if u.FlushCache == nil {
		t := true
		u.FlushCache = &t
	}
}

// UpdateWeightFromDiskReqOutput answers UpdateWeightFromDiskReqInput.
type UpdateWeightFromDiskReqOutput struct {
	Result           `msgpack:",inline"`
	NumPausedRequest int `msgpack:"num_paused_requests" json:"num_paused_requests"`
}

// TypeName implements Message.
func (*UpdateWeightFromDiskReqOutput) TypeName() string { return "UpdateWeightFromDiskReqOutput" }

// UpdateWeightsFromTensorReqInput carries weights from a trainer on the
// same node: per TP rank, ForkingPickler's pickle of the tensors (CUDA IPC
// handles, or POSIX shared memory for CPU tensors), as SGLang's
// MultiprocessingSerializer writes it.
type UpdateWeightsFromTensorReqInput struct {
	Control                `msgpack:",inline"`
	SerializedNamedTensors SerializedPayloads `msgpack:"serialized_named_tensors" json:"serialized_named_tensors"`
	LoadFormat             *string            `msgpack:"load_format" json:"load_format"`
	FlushCache             *bool              `msgpack:"flush_cache" json:"flush_cache"`
	AbortAllRequests       bool               `msgpack:"abort_all_requests" json:"abort_all_requests"`
	WeightVersion          *string            `msgpack:"weight_version" json:"weight_version"`
}

// TypeName implements Message.
func (*UpdateWeightsFromTensorReqInput) TypeName() string { return "UpdateWeightsFromTensorReqInput" }

func (u *UpdateWeightsFromTensorReqInput) applyDefaults() { u.FlushCache = defaultTrue(u.FlushCache) }

func defaultTrue(b *bool) *bool {
	if b == nil {
		t := true
		return &t
	}
	return b
}

// UpdateWeightsFromTensorReqOutput answers UpdateWeightsFromTensorReqInput.
type UpdateWeightsFromTensorReqOutput struct {
	Result `msgpack:",inline"`
	// Tensors and Bytes count what was written (ebb).
	Tensors int   `msgpack:"tensors" json:"tensors"`
	Bytes   int64 `msgpack:"bytes" json:"bytes"`
}

// TypeName implements Message.
func (*UpdateWeightsFromTensorReqOutput) TypeName() string {
	return "UpdateWeightsFromTensorReqOutput"
}

// InitWeightsUpdateGroupReqInput joins the trainer's process group (NCCL)
// as rank rank_offset + TP rank; the trainer is rank 0 and hosts the
// TCPStore at master_address:master_port.
type InitWeightsUpdateGroupReqInput struct {
	Control    `msgpack:",inline"`
	MasterAddr string `msgpack:"master_address" json:"master_address"`
	MasterPort int    `msgpack:"master_port" json:"master_port"`
	RankOffset int    `msgpack:"rank_offset" json:"rank_offset"`
	WorldSize  int    `msgpack:"world_size" json:"world_size"`
	GroupName  string `msgpack:"group_name" json:"group_name"`
	Backend    string `msgpack:"backend" json:"backend"`
}

// TypeName implements Message.
func (*InitWeightsUpdateGroupReqInput) TypeName() string { return "InitWeightsUpdateGroupReqInput" }

// DefaultWeightGroup is SGLang's default group_name.
const DefaultWeightGroup = "weight_update_group"

func (i *InitWeightsUpdateGroupReqInput) applyDefaults() {
	if i.GroupName == "" {
		i.GroupName = DefaultWeightGroup
	}
	if i.Backend == "" {
		i.Backend = "nccl"
	}
}

// InitWeightsUpdateGroupReqOutput answers InitWeightsUpdateGroupReqInput.
type InitWeightsUpdateGroupReqOutput struct {
	Result `msgpack:",inline"`
}

// TypeName implements Message.
func (*InitWeightsUpdateGroupReqOutput) TypeName() string { return "InitWeightsUpdateGroupReqOutput" }

// DestroyWeightsUpdateGroupReqInput leaves a group made by
// InitWeightsUpdateGroupReqInput.
type DestroyWeightsUpdateGroupReqInput struct {
	Control   `msgpack:",inline"`
	GroupName string `msgpack:"group_name" json:"group_name"`
}

// TypeName implements Message.
func (*DestroyWeightsUpdateGroupReqInput) TypeName() string {
	return "DestroyWeightsUpdateGroupReqInput"
}

func (d *DestroyWeightsUpdateGroupReqInput) applyDefaults() {
	if d.GroupName == "" {
		d.GroupName = DefaultWeightGroup
	}
}

// DestroyWeightsUpdateGroupReqOutput answers DestroyWeightsUpdateGroupReqInput.
type DestroyWeightsUpdateGroupReqOutput struct {
	Result `msgpack:",inline"`
}

// TypeName implements Message.
func (*DestroyWeightsUpdateGroupReqOutput) TypeName() string {
	return "DestroyWeightsUpdateGroupReqOutput"
}

// UpdateWeightsFromDistributedReqInput receives weights by NCCL broadcast
// from rank 0, one broadcast per name in order (or one of the whole
// flattened bucket with load_format "flattened_bucket").
type UpdateWeightsFromDistributedReqInput struct {
	Control          `msgpack:",inline"`
	Names            []string `msgpack:"names" json:"names"`
	DTypes           []string `msgpack:"dtypes" json:"dtypes"`
	Shapes           [][]int  `msgpack:"shapes" json:"shapes"`
	GroupName        string   `msgpack:"group_name" json:"group_name"`
	FlushCache       *bool    `msgpack:"flush_cache" json:"flush_cache"`
	AbortAllRequests bool     `msgpack:"abort_all_requests" json:"abort_all_requests"`
	WeightVersion    *string  `msgpack:"weight_version" json:"weight_version"`
	LoadFormat       *string  `msgpack:"load_format" json:"load_format"`
}

// TypeName implements Message.
func (*UpdateWeightsFromDistributedReqInput) TypeName() string {
	return "UpdateWeightsFromDistributedReqInput"
}

func (u *UpdateWeightsFromDistributedReqInput) applyDefaults() {
	u.FlushCache = defaultTrue(u.FlushCache)
	if u.GroupName == "" {
		u.GroupName = DefaultWeightGroup
	}
}

// UpdateWeightsFromDistributedReqOutput answers it.
type UpdateWeightsFromDistributedReqOutput struct {
	Result `msgpack:",inline"`
	// Tensors and Bytes count what was received (ebb).
	Tensors int   `msgpack:"tensors" json:"tensors"`
	Bytes   int64 `msgpack:"bytes" json:"bytes"`
}

// TypeName implements Message.
func (*UpdateWeightsFromDistributedReqOutput) TypeName() string {
	return "UpdateWeightsFromDistributedReqOutput"
}

// UpdateWeightVersionReqInput sets the weight_version reported from now on.
type UpdateWeightVersionReqInput struct {
	Control          `msgpack:",inline"`
	NewVersion       string `msgpack:"new_version" json:"new_version"`
	AbortAllRequests bool   `msgpack:"abort_all_requests" json:"abort_all_requests"`
}

// TypeName implements Message.
func (*UpdateWeightVersionReqInput) TypeName() string { return "UpdateWeightVersionReqInput" }

// UpdateWeightVersionReqOutput answers UpdateWeightVersionReqInput.
type UpdateWeightVersionReqOutput struct {
	Result `msgpack:",inline"`
}

// TypeName implements Message.
func (*UpdateWeightVersionReqOutput) TypeName() string { return "UpdateWeightVersionReqOutput" }

// GetWeightsByNameReqInput reads back a parameter for verification.
type GetWeightsByNameReqInput struct {
	Control      `msgpack:",inline"`
	Name         string `msgpack:"name" json:"name"`
	TruncateSize int    `msgpack:"truncate_size" json:"truncate_size"`
}

// TypeName implements Message.
func (*GetWeightsByNameReqInput) TypeName() string { return "GetWeightsByNameReqInput" }

func (g *GetWeightsByNameReqInput) applyDefaults() {
	if g.TruncateSize == 0 {
		g.TruncateSize = 100 // SGLang's default
	}
}

// GetWeightsByNameReqOutput answers GetWeightsByNameReqInput.
type GetWeightsByNameReqOutput struct {
	Result    `msgpack:",inline"`
	Parameter []float32 `msgpack:"parameter" json:"parameter"`
	Shape     []int     `msgpack:"shape" json:"shape"` // ebb: the full shape
}

// TypeName implements Message.
func (*GetWeightsByNameReqOutput) TypeName() string { return "GetWeightsByNameReqOutput" }

// GetMemoryStatsReqInput asks for per-tag memory figures (ebb).
type GetMemoryStatsReqInput struct {
	Control `msgpack:",inline"`
}

// TypeName implements Message.
func (*GetMemoryStatsReqInput) TypeName() string { return "GetMemoryStatsReqInput" }

// GetMemoryStatsReqOutput answers GetMemoryStatsReqInput.
type GetMemoryStatsReqOutput struct {
	Result             `msgpack:",inline"`
	Tags               []memory.TagStats `msgpack:"tags" json:"tags"`
	WorkspaceReserved  int64             `msgpack:"workspace_reserved_bytes" json:"workspace_reserved_bytes"`
	WorkspaceAllocated int64             `msgpack:"workspace_allocated_bytes" json:"workspace_allocated_bytes"`
	NVMLProcessBytes   int64             `msgpack:"nvml_process_bytes" json:"nvml_process_bytes"` // -1: unknown
	NVMLUsedBytes      int64             `msgpack:"nvml_device_used_bytes" json:"nvml_device_used_bytes"`
	NVMLTotalBytes     int64             `msgpack:"nvml_device_total_bytes" json:"nvml_device_total_bytes"`
	DriverFreeBytes    int64             `msgpack:"driver_free_bytes" json:"driver_free_bytes"`
	WeightsStale       bool              `msgpack:"weights_stale" json:"weights_stale"`
	// ReleasedTags are the regions released now; GenerationBlocked says
	// why requests cannot run ("" when they can) and WaitingRequests how
	// many wait for it (ebb).
	ReleasedTags      []string `msgpack:"released_tags" json:"released_tags"`
	GenerationBlocked string   `msgpack:"generation_blocked" json:"generation_blocked"`
	WaitingRequests   int      `msgpack:"waiting_requests" json:"waiting_requests"`
}

// TypeName implements Message.
func (*GetMemoryStatsReqOutput) TypeName() string { return "GetMemoryStatsReqOutput" }

// GetServerInfoReqInput asks the scheduler for its state and limits.
type GetServerInfoReqInput struct {
	Control `msgpack:",inline"`
}

// TypeName implements Message.
func (*GetServerInfoReqInput) TypeName() string { return "GetServerInfoReqInput" }

// GetServerInfoReqOutput answers GetServerInfoReqInput.
type GetServerInfoReqOutput struct {
	Result `msgpack:",inline"`
	Info   map[string]any `msgpack:"info" json:"info"`
}

// TypeName implements Message.
func (*GetServerInfoReqOutput) TypeName() string { return "GetServerInfoReqOutput" }

// WeightWrite reports whether m writes the weights (an update from disk,
// tensor or a distributed group), and its abort_all_requests.
func WeightWrite(m Message) (abortAll, ok bool) {
	switch r := m.(type) {
	case *UpdateWeightFromDiskReqInput:
		return r.AbortAllRequests, true
	case *UpdateWeightsFromTensorReqInput:
		return r.AbortAllRequests, true
	case *UpdateWeightsFromDistributedReqInput:
		return r.AbortAllRequests, true
	}
	return false, false
}
