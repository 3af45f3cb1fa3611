package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"ebb/engine"
	"ebb/launcher"
)

// newLogger writes human-readable logs to stderr at level.
func newLogger(level, name string) (*zap.Logger, error) {
	lvl, err := zapcore.ParseLevel(level)
	if err != nil {
		return nil, fmt.Errorf("--log-level: %w", err)
	}
	cfg := zap.NewProductionConfig()
	cfg.Level = zap.NewAtomicLevelAt(lvl)
	cfg.Encoding = "console"
	cfg.EncoderConfig.EncodeTime = zapcore.ISO8601TimeEncoder
	cfg.DisableStacktrace = true
	log, err := cfg.Build()
	if err != nil {
		return nil, err
	}
	return log.Named(name), nil
}

func serveCmd() *cobra.Command {
	var cfg launcher.Config
	var sf serverFlags
	cmd := &cobra.Command{
		Use:   "serve --model-path DIR [--host H] [--port P] [--zmq-endpoint E] [SGLang's launch_server flags]",
		Short: "Serve a model: SGLang's HTTP API, OpenAI endpoints and the external ZMQ API",
		RunE: func(*cobra.Command, []string) error {
			log, err := newLogger(cfg.LogLevel, "ebb")
			if err != nil {
				return err
			}
			defer log.Sync()
			if cfg.Engine.ModelDir == "" {
				return fmt.Errorf("give the model directory with --model-path")
			}
			if err := engine.CheckDType(cfg.Engine.DType); err != nil {
				return err
			}
			cfg.APIKey, cfg.SkipWarmup = sf.apiKey, sf.skipWarmup
			if sf.maxRequestBodyMB < 0 {
				return fmt.Errorf("--max-request-body-mb must be positive, got %d", sf.maxRequestBodyMB)
			}
			cfg.AllowAutoTruncate, cfg.MaxRequestBodyBytes = sf.allowAutoTruncate, sf.maxRequestBodyMB<<20
			cfg.IncrementalStreamingOutput = sf.incrementalStreaming
			cfg.ReasoningParser, cfg.ToolCallParser = sf.reasoningParser, sf.toolCallParser
			ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
			defer stop()
			cfg.Ready = func(addr, zmqEndpoint string) {
				fmt.Fprintf(os.Stderr, "\nebb is ready on http://%s", addr)
				if zmqEndpoint != "" {
					fmt.Fprintf(os.Stderr, " (external ZMQ API: %s)", zmqEndpoint)
				}
				fmt.Fprintf(os.Stderr, "\nTry:\n  curl -s http://%s/generate -H 'Content-Type: application/json' \\\n"+
					"    -d '{\"text\": \"package main\\n\\nimport (\\n\", \"sampling_params\": {\"max_new_tokens\": 32, \"temperature\": 0}}'\n\n", addr)
			}
			return launcher.Run(ctx, cfg, log)
		},
	}
	f := cmd.Flags()
	addEngineFlags(f, &cfg.Engine)
	f.StringVar(&cfg.Host, "host", "127.0.0.1", "HTTP listen address")
	f.IntVar(&cfg.Port, "port", 30000, "HTTP port")
	f.StringVar(&cfg.ZMQEndpoint, "zmq-endpoint", "", `external ZMQ ROUTER endpoint (default tcp://127.0.0.1:<port+1>; "none" disables)`)
	f.StringVar(&cfg.ModelName, "served-model-name", "", "model name for the OpenAI endpoints (default: the directory name)")
	f.StringVar(&cfg.LogLevel, "log-level", "info", "debug, info, warn or error")
	f.StringVar(&cfg.LoadBalanceMethod, "load-balance-method", "auto", "with --dp-size, the engine of a request that names none (routed_dp_rank): "+
		"auto (least unfinished work, counting the prompt prefix each engine holds; SGLang's prefix_affinity is the same), "+
		"round_robin, total_requests or total_tokens")
	addServerFlags(f, &sf)
	cmd.SetFlagErrorFunc(unknownFlagHelp)
	return cmd
}

func childCmd() *cobra.Command {
	return &cobra.Command{
		Use:    "__child ROLE RUNTIME_DIR",
		Hidden: true,
		Args:   cobra.ExactArgs(2),
		RunE: func(_ *cobra.Command, args []string) error {
			return launcher.RunChild(args[0], args[1], newLogger)
		},
	}
}
